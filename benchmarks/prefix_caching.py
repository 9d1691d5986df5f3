"""Prefix caching on a shared-prefix workload: the same engine with and without it, in one run (issue 14).

    python benchmarks/prefix_caching.py [--json out.json]                      # H200: llama3-8b
    python benchmarks/prefix_caching.py --device cpu --model tiny --num-requests 8 --prefix-len 64 \\
        --suffix-len 8 --max-tokens 4                                           # a smoke test

Workload: `--num-requests` (64) requests whose prompts are one shared `--prefix-len` (1,024)
token prefix followed by a unique `--suffix-len` (64) token suffix, `--max-tokens` (64) new
tokens each, greedy, EOS ignored, all queued at once. Per engine (prefix caching on, then off;
same weights, backend and CUDA graph mode): one warm-up run of the workload with ANOTHER shared
prefix (kernels compiled, graphs captured, and nothing of the timed prefix cached), then the
timed run. Reported: output tokens/s, time to first token per request (from the moment all
requests are queued to the step that returns its first token: mean, median, p90), prefill
steps, and the tokens the cache served.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import engine_bench  # noqa: E402  (beside this file: the device, release, the timed run)
from engine_bench import release, timed_run  # noqa: E402
from pagedkv import LLM  # noqa: E402


def shared_prefix_prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]


def measure(args: argparse.Namespace, caching: bool) -> dict[str, object]:
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.backend,
        cudagraph_mode=args.cudagraph_mode,
        enable_prefix_caching=caching,
        max_num_seqs=max(args.num_requests, 8),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 16,
        kv_cache_memory=args.kv_cache_gib * 2**30,
        batch_invariant=args.batch_invariant,
    )
    vocab = llm.model_config.vocab_size
    timed_run(llm, shared_prefix_prompts(args, vocab, seed=1), args.max_tokens)  # warm-up, another prefix
    row = {
        "prefix_caching": caching,
        "resolved_mode": llm.runner.cudagraph_mode.name,
        **timed_run(llm, shared_prefix_prompts(args, vocab, seed=0), args.max_tokens),
    }
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    del llm
    release()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--backend", default=None, help="attention backend (default: the platform's choice)")
    p.add_argument("--cudagraph-mode", default="FULL")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=int, default=16)
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="both engines in the batch-invariant mode: cached or not, each request's tokens must be identical",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    engine_bench.DEVICE = args.device
    if args.device != "cuda":
        args.cudagraph_mode = "NONE"
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "workload": {
            k: getattr(args, k)
            for k in (
                "model",
                "num_requests",
                "prefix_len",
                "suffix_len",
                "max_tokens",
                "max_num_batched_tokens",
                "cudagraph_mode",
                "dtype",
                "batch_invariant",
            )
        },
    }
    rows = [measure(args, caching) for caching in (True, False)]
    on, off = rows
    result["throughput_ratio"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    # With and without caching the prefix's K/V come from differently shaped batches, so in bf16
    # rounding differs and a greedy run on random weights (many near-ties) may diverge: count them
    # (with --batch-invariant every request must be identical).
    result["identical_requests"] = sum(a == b for a, b in zip(on.pop("tokens"), off.pop("tokens")))
    print(
        f"\n{args.model}: {args.num_requests} requests, shared prefix {args.prefix_len} + suffix {args.suffix_len}, "
        f"{args.max_tokens} new tokens, {rows[0]['resolved_mode']}{', batch-invariant' if args.batch_invariant else ''}"
    )
    print(
        f"{'prefix caching':<16}{'s':>8}{'out tok/s':>11}{'TTFT mean':>11}{'median':>9}{'p90':>9}"
        f"{'prefill steps':>15}{'computed':>10}{'cached':>9}"
    )
    for r in rows:
        print(
            f"{'on' if r['prefix_caching'] else 'off':<16}{r['seconds']:8.2f}{r['output_tokens_per_s']:11.0f}"
            f"{r['ttft_mean_s']:11.3f}{r['ttft_median_s']:9.3f}{r['ttft_p90_s']:9.3f}{r['prefill_steps']:15d}"
            f"{r['prefill_tokens_computed']:10d}{r['cached_tokens']:9d}"
        )
    print(
        f"throughput with / without: {result['throughput_ratio']:.2f}x (target >= 2x); "
        f"requests with identical tokens: {result['identical_requests']} of {args.num_requests}"
    )
    result["rows"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
