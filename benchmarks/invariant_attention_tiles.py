"""The batch-invariant mode's attention tiles by batch shape: bits and speed of each candidate (issue 45).

    python benchmarks/invariant_attention_tiles.py [--json out.json]          # one H100 or H200, meant for < 2 min
    TRITON_INTERPRET=1 python benchmarks/invariant_attention_tiles.py --smoke   # runs, on the CPU

`batch_invariant_config` (pagedkv/kernels/attention_config.py) picks the query-row tile (rows, warps,
stages) from `INVARIANT_ATTENTION_TILES` by the query rows of the batch's longest request; the keys
per tile stay 64 and start at key 0, and nothing is split, so a row's sums run in the same order
in every candidate. Its dots still run on other instructions (mma.sync for 16 rows, wgmma from 64
on), and whether those agree bit for bit is the hardware's answer, not the code's.

Per candidate (rows, keys = 64, warps, stages), on Llama-3-8B's attention shapes (bf16), one case
per bucket of the table (W1's decode step of 128 requests, 32 short chunks, a mixed step of 64
decodes + a 2,048-token chunk, two 2,048-token prompts): how many tokens' outputs (all heads) equal
the reference tile's (the table's first entry) bitwise, and its time (do_bench medians) against the
table's pick for the case; the mode's tile before issue 45 (16 rows) is among the candidates. Then
per bucket the fastest candidate that gave every token of every case the reference's bits. Under the interpreter (--smoke) the dots
are numpy's, whose BLAS also blocks by shape: there the count says only that the script runs.
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

from llama_batch import HKV, HQ, llama_batch  # noqa: E402
from pagedkv.kernels import unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import (  # noqa: E402
    INVARIANT_ATTENTION_TILE_CHOICES,
    INVARIANT_ATTENTION_TILES,
    KernelConfig,
    Tiles,
)
from pagedkv.kernels.common import by_size  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402

G = HQ // HKV
REFERENCE = INVARIANT_ATTENTION_TILES[0][1]
CANDIDATES: list[Tiles] = list(
    dict.fromkeys(
        [
            *INVARIANT_ATTENTION_TILE_CHOICES,
            Tiles(16, 64, 4, 2),  # the mode's one tile before issue 45
            Tiles(32, 64, 4, 2),
            Tiles(64, 64, 4, 2),
            Tiles(64, 64, 4, 3),
            Tiles(64, 64, 4, 4),
            Tiles(128, 64, 4, 2),
            Tiles(128, 64, 8, 2),
            Tiles(128, 64, 8, 3),
        ]
    )
)
"""Keys stay at the mode's 64 per tile: the order of every row's sums."""


def cases(smoke: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lengths, cached context lengths)."""
    if smoke:
        return {"mixed": ([1, 1, 9], [20, 7, 0])}
    return {
        "decode 128 x 1 over 600": ([1] * 128, [600] * 128),
        "short 32 x 32 over 300": ([32] * 32, [300] * 32),
        "mixed 64 decodes + 4 x 512": ([1] * 64 + [512] * 4, [600] * 64 + [300] * 4),
        "prefill 2 x 2048": ([2048] * 2, [0] * 2),
    }


def bucket(query_lens: list[int]) -> str:
    """The INVARIANT_ATTENTION_TILES bucket of a batch, by its longest request's query rows."""
    indexed = tuple((bound, f"rows <= {bound}" if bound else "more rows") for bound, _ in INVARIANT_ATTENTION_TILES)
    return by_size(indexed, G * max(query_lens))


def knobs(tiles: Tiles) -> list[int]:
    """[rows, keys, warps, stages]"""
    return [tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages]


def run(batch: PagedBatch, tiles: Tiles) -> torch.Tensor:
    out = torch.empty_like(batch.q)
    config = KernelConfig(tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages)
    unified_attention(batch.q, batch.k_cache, batch.v_cache, out, **batch.attention_kwargs(), config=config)
    return out


def us(batch: PagedBatch, tiles: Tiles) -> float:
    return triton.testing.do_bench(lambda: run(batch, tiles), return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="one tiny batch on the CPU, no timing")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/invariant_attention_tiles.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    timed = not args.smoke
    rows = []
    for name, (query_lens, context_lens) in cases(args.smoke).items():
        batch = llama_batch(query_lens, context_lens, device=device)
        expected = run(batch, REFERENCE)
        pick = by_size(INVARIANT_ATTENTION_TILES, G * batch.max_query_len)
        pick_us = us(batch, pick) if timed else None
        for tiles in CANDIDATES:
            got = run(batch, tiles)
            row = {
                "case": name,
                "bucket": bucket(query_lens),
                "tiles": knobs(tiles),
                "table_pick": tiles == pick,
                "tokens_bitwise_equal": int((got == expected).all(-1).all(-1).sum()),
                "tokens": got.shape[0],
                "max_abs_diff": (got.float() - expected.float()).abs().max().item(),
            }
            if timed:
                row["us"] = us(batch, tiles)
                row["speedup_over_table_pick"] = pick_us / row["us"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nreference tile (whose bits every candidate must give): {knobs(REFERENCE)}")
    print(f"{'case':<30}{'tiles':<24}{'tokens equal':>14}{'max |diff|':>12}{'us':>9}{'x table pick':>14}")
    for r in rows:
        equal = f"{r['tokens_bitwise_equal']}/{r['tokens']}"
        timing = f"{r['us']:9.1f}{r['speedup_over_table_pick']:13.2f}x" if timed else f"{'-':>9}{'-':>14}"
        mark = " (table)" if r["table_pick"] else ""
        print(f"{r['case']:<30}{str(r['tiles']) + mark:<24}{equal:>14}{r['max_abs_diff']:>12.2e}{timing}")

    # A candidate is fit for the table only if every token of every case has the reference's bits.
    equal_everywhere = {
        str(t): all(r["tokens_bitwise_equal"] == r["tokens"] for r in rows if r["tiles"] == t)
        for t in (r["tiles"] for r in rows)
    }
    best_per_bucket = []
    if timed:
        print(f"\n{'bucket (rows of the longest request)':<38}{'table pick (us)':<28}{'fastest bitwise-equal (us)'}")
        for name in dict.fromkeys(r["bucket"] for r in rows):
            mine = [r for r in rows if r["bucket"] == name]
            cost = {str(r["tiles"]): 0.0 for r in mine}
            for r in mine:
                cost[str(r["tiles"])] += r["us"]
            pick = next(str(r["tiles"]) for r in mine if r["table_pick"])
            fit = [t for t in cost if equal_everywhere[t]]
            fastest = min(fit, key=cost.__getitem__, default=None)
            best_per_bucket.append(
                {"bucket": name, "table_tiles": pick, "table_us": cost[pick], "fastest_tiles": fastest}
                | ({"fastest_us": cost[fastest]} if fastest else {})
            )
            best = f"{fastest} {cost[fastest]:.1f}" if fastest else "none"
            print(f"{name:<38}{pick + f' {cost[pick]:.1f}':<28}{best}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(torch.cuda.get_device_name() if device == "cuda" else device),
                    "reference_tiles": knobs(REFERENCE),
                    "rows": rows,
                    "bitwise_equal_everywhere": equal_everywhere,
                    "best_per_bucket": best_per_bucket,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
