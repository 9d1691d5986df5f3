"""Tensor parallelism on the GPUs of one host: tp = 2 against tp = 1 (issue 12), same run.

    python benchmarks/tensor_parallel.py [--json out.json]          # 2 GPUs, NCCL
    python benchmarks/tensor_parallel.py --device cpu --model tiny  # a smoke test (gloo)

First a check: the tiny preset in float32, tp = 2 against tp = 1, every step's logits. Then per
tp: decode step latency (median wall time of `llm.step()` while every request decodes) at
batch 1 and 64, and workload W1 (`workloads.py`: 128 requests, prompts of 100-1024 tokens,
128 new tokens) in output tokens per second, timed on a second run. Both tp run the same
`--cudagraph-mode` (FULL by default: whole-model graphs, the all-reduces captured inside; tp > 1
does not compile piecewise graphs yet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import engine_bench  # noqa: E402  (beside this file, as are the next two)
from pagedkv import LLM, SamplingParams  # noqa: E402
from step_timing import decode_latency  # noqa: E402
from workloads import w1_prompts  # noqa: E402


def logits_check(device: str) -> float:
    """Largest difference between tp = 2 and tp = 1 logits over a short greedy run (tiny, float32)."""
    rows: dict[int, list[torch.Tensor]] = {}
    for tp in (1, 2):
        with LLM("tiny", device=device, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp) as llm:
            llm.add_step_listener(lambda event, tp=tp: rows.setdefault(tp, []).append(event.result.logits.cpu()))
            llm.generate(
                ["tensor parallel", "a second prompt"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
            )
    return max((a - b).abs().max().item() for a, b in zip(rows[1], rows[2]))


def measure(model: str, device: str, tp: int, args: argparse.Namespace) -> dict[str, object]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    row: dict[str, object] = {"tp": tp}
    prompts = w1_prompts(args.num_requests)
    engine = dict(
        device=device,
        dtype=dtype,
        tensor_parallel_size=tp,
        cudagraph_mode=args.cudagraph_mode,
        max_num_seqs=max(args.num_requests, 64),
        max_num_batched_tokens=4096,
        max_model_len=2048,
        kv_cache_memory=args.kv_cache_gib * 2**30,
    )
    with LLM(model, **engine) as llm:
        vocab = llm.model_config.vocab_size
        prompts = [[t % vocab for t in p] for p in prompts]
        for batch in args.batches:
            row[f"decode_ms_batch{batch}"] = decode_latency(llm, batch, 512, args.decode_steps)["step_ms"]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engine_bench.generate_s(llm, prompts, params)  # warm-up
        seconds, outs = engine_bench.generate_s(llm, prompts, params)
        row["w1_seconds"] = seconds
        row["w1_output_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
        row["first_tokens"] = outs[0].outputs[0].token_ids[:8]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=int, default=16, help="per rank")
    p.add_argument("--cudagraph-mode", default="FULL", help="NONE, FULL or FULL_DECODE_ONLY (same for both tp)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    engine_bench.DEVICE = args.device
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "cudagraph_mode": args.cudagraph_mode,
    }
    result["tiny_float32_max_logit_diff_tp2_vs_tp1"] = logits_check(args.device)
    print(
        f"tiny, float32: tp = 2 logits within {result['tiny_float32_max_logit_diff_tp2_vs_tp1']:.2e} of tp = 1",
        flush=True,
    )
    rows = [measure(args.model, args.device, tp, args) for tp in (1, 2)]
    result["rows"] = rows
    print(
        f"\n{args.model}, {args.cudagraph_mode:<13}"
        + "".join(f"{'tp ' + str(r['tp']):>12}" for r in rows)
        + "   speed-up of tp 2"
    )
    for key in [k for k in rows[0] if k.startswith(("decode", "w1"))]:
        lower_is_better = not key.endswith("per_s")
        ratio = rows[0][key] / rows[1][key] if lower_is_better else rows[1][key] / rows[0][key]
        print(f"{key:<26}" + "".join(f"{r[key]:12.2f}" for r in rows) + f"   {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
