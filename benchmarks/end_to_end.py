"""Whole-engine throughput through `LLM`, one row per attention backend, same run.

    python benchmarks/end_to_end.py [--model llama3-8b] [--backends TRITON_ATTN FLASH_ATTN] [--json out.json]

Random-weight Llama-3-8B shapes in bf16: `--num-prompts` prompts of `--prompt-len` tokens, each
generating `--max-tokens` tokens with greedy sampling (EOS ignored). Steps run eagerly (no CUDA
graphs yet), so small decode batches are bound by Python and launch overhead, not by attention.
Reports tokens/s and the ratio to the first backend.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv import LLM, SamplingParams  # noqa: E402


def run(model: str, backend: str, num_prompts: int, prompt_len: int, max_tokens: int) -> dict[str, object]:
    llm = LLM(model, device="cuda", dtype="bfloat16", attention_backend=backend, max_model_len=8192,
              max_num_seqs=max(num_prompts, 1), max_num_batched_tokens=4096, kv_cache_memory=16 * 2**30)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 32000 + 100 for j in range(prompt_len)]} for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"backend": backend, "seconds": seconds, "output_tokens_per_s": generated / seconds,
           "total_tokens_per_s": (generated + num_prompts * prompt_len) / seconds,
           "steps": llm.stats.num_steps, "num_kv_blocks": llm.runner.kv_cache_config.num_blocks,
           "first_tokens": outs[0].outputs[0].token_ids[:8]}
    del llm
    gc.collect()  # the model and its layers reference each other through the forward-context dict
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--backends", nargs="+", default=["TRITON_ATTN", "FLASH_ATTN", "TORCH_REF"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/end_to_end.py needs a CUDA GPU")
    rows = []
    for backend in args.backends:
        try:
            rows.append(run(args.model, backend, args.num_prompts, args.prompt_len, args.max_tokens))
        except Exception as exc:  # a backend that cannot run here says why in the table
            rows.append({"backend": backend, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["total_tokens_per_s"] for r in rows if "error" not in r), None)
    print(f"\n{args.model}, {args.num_prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} tokens each")
    print(f"{'backend':<12}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}{'x first':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:<12}  {r['error']}")
            continue
        print(f"{r['backend']:<12}{r['seconds']:9.2f}{r['output_tokens_per_s']:11.0f}{r['total_tokens_per_s']:13.0f}"
              f"{r['total_tokens_per_s'] / base:9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
