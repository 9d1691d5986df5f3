"""Scratch (not committed): where does an async step sync with the GPU?"""
import collections, sys, time, traceback, warnings
import torch
from pagedkv import LLM, SamplingParams

mode = sys.argv[1] if len(sys.argv) > 1 else "FULL_DECODE_ONLY"
llm = LLM("llama3-8b", cudagraph_mode=mode, kv_cache_memory=8 << 30, max_num_seqs=64, async_scheduling=True)
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for i in range(64):
    llm.add_request({"prompt_token_ids": [(7 * i + j) % 30000 + 5 for j in range(200)]}, p)
for _ in range(8):
    llm.step()
sites = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    stack = [f for f in traceback.extract_stack()[:-2] if "pagedkv" in f.filename]
    sites[" <- ".join(f"{f.filename.split('pagedkv/')[-1]}:{f.lineno}" for f in stack[-3:][::-1])] += 1
warnings.showwarning = show
torch.cuda.set_sync_debug_mode(1)
t = time.perf_counter(); n = 0
while n < 10:
    llm.step(); n += 1
torch.cuda.set_sync_debug_mode(0)
for s, c in sites.most_common(12): print(c, s)
torch.cuda.synchronize()
for a in (False, True):
    llm.async_scheduling = a
    for i in range(64):
        llm.add_request({"prompt_token_ids": [(11 * i + j + 3 * a) % 30000 + 5 for j in range(300)]}, p)
    while llm.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.scheduler.running):
        llm.step()
    torch.cuda.synchronize(); t = time.perf_counter(); k = 0
    for _ in range(30):
        llm.step(); k += 1
    torch.cuda.synchronize(); print(f"async={a} decode step {1e3 * (time.perf_counter() - t) / k:.2f} ms (bs {len(llm.scheduler.running)})")
    while llm.has_unfinished_requests(): llm.step()
