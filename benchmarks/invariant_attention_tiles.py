"""Could the batch-invariant mode's attention run prefills in wider query tiles? (issue 35, H200)

    python benchmarks/invariant_attention_tiles.py [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/invariant_attention_tiles.py --smoke   # runs, on the CPU

The mode runs every batch with `batch_invariant_config`'s one tile: 16 query rows (4 tokens x the
4 query heads of a KV head) by 64 keys, so a 4,096-token prefill chunk is 8,192 programs, each
reading its keys again; the default mode's prefill tiles have 128 rows. A wider tile keeps each
row's sum in the same order (64-key tiles from key 0; tiles past a row's last key add exact zeros
and rescale by exactly 1), but its dots run on other instructions (wgmma from 64 rows on, mma.sync
for 16), and whether those agree bit for bit is the hardware's answer, not the code's.

Per candidate (rows, keys = 64, warps, stages), on Llama-3-8B's attention shapes (bf16): how many
tokens' outputs (all heads) equal the 16-row tile's bitwise, and its time against it (do_bench medians), on
a W1-like mixed batch (64 decodes over 600 cached tokens + a 2,048-token chunk of 4 prompts) and
a pure prefill (8 prompts of 512). If every row agrees, `batch_invariant_config` may pick wider
tiles for batches with long queries without breaking the mode (tests/gpu then guards it).
Under the interpreter (--smoke) the dots are numpy's, whose BLAS also blocks by shape: there the
count says only that the script runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_batch import HKV, HQ, D, llama_batch  # noqa: E402
from pagedkv.kernels import unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import KernelConfig, batch_invariant_config  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402

CANDIDATES = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3)]
"""(query rows, keys, warps, stages); keys stay at the mode's 64, the order of every row's sum."""


def cases(smoke: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lengths, cached context lengths)."""
    if smoke:
        return {"mixed": ([1, 1, 9], [20, 7, 0])}
    return {
        "mixed 64 decodes + 2K chunk": ([1] * 64 + [512] * 4, [600] * 64 + [300] * 4),
        "prefill 8x512": ([512] * 8, [0] * 8),
    }


def run(batch: PagedBatch, config: KernelConfig) -> torch.Tensor:
    out = torch.empty_like(batch.q)
    unified_attention(batch.q, batch.k_cache, batch.v_cache, out, **batch.attention_kwargs(), config=config)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="one tiny batch on the CPU, no timing")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/invariant_attention_tiles.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    rows = []
    for name, (query_lens, context_lens) in cases(args.smoke).items():
        batch = llama_batch(query_lens, context_lens, device=device)
        base = batch_invariant_config(
            device=batch.q.device, head_pad=D, dtype=batch.q.dtype, num_queries_per_kv=HQ // HKV
        )
        expected = run(batch, base)
        timed = not args.smoke
        base_us = (
            triton.testing.do_bench(lambda b=batch, c=base: run(b, c), return_mode="median") * 1e3 if timed else None
        )
        for candidate in CANDIDATES:
            config = KernelConfig(*candidate)
            got = run(batch, config)
            row = {
                "case": name,
                "tiles": list(candidate),
                "tokens_bitwise_equal": int((got == expected).all(-1).all(-1).sum()),
                "tokens": got.shape[0],
                "max_abs_diff": (got.float() - expected.float()).abs().max().item(),
            }
            if timed:
                row["us"] = triton.testing.do_bench(lambda b=batch, c=config: run(b, c), return_mode="median") * 1e3
                row["speedup_over_16_rows"] = base_us / row["us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':<30}{'tiles':<20}{'tokens equal':>14}{'max |diff|':>12}{'speed-up':>10}")
    for r in rows:
        speedup = f"{r['speedup_over_16_rows']:.2f}x" if "us" in r else "-"
        equal = f"{r['tokens_bitwise_equal']}/{r['tokens']}"
        print(f"{r['case']:<30}{str(r['tiles']):<20}{equal:>14}{r['max_abs_diff']:>12.2e}{speedup:>10}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": str(torch.cuda.get_device_name() if device == "cuda" else device), "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
