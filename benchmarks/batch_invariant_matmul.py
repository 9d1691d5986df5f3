"""The batch-invariant matmul's tiles by M: candidates against cuBLAS on llama3-8b's linear layers (issue 45).

    python benchmarks/batch_invariant_matmul.py [--json out.json]      # one H100 or H200, meant for < 2 min

The batch-invariant mode (pagedkv/batch_invariant.py) picks the matmul's tiles by the number of
rows M from `MATMUL_TILES_BY_M` (pagedkv/kernels/batch_invariant_triton.py): every candidate has
BLOCK_K = 64 and no split-K, so a row's sums run in the same order in each, and a candidate may
join the table only if the GPU gives its rows the same bits as the others'. Per candidate
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) and M in {1, 16, 64, 128, 512, 4096}: microseconds summed
over llama3-8b's four layer shapes (`triton.testing.do_bench`, median), the ratio to torch.mm
(cuBLAS, which picks a kernel per shape) in the same run, and whether every output row, on every
shape, equals bit for bit the same row of a 4,096-row call with the reference tiles (the table's
largest-M entry). Then, per bucket of the table, the fastest bitwise-equal candidate over the
bucket's M values, beside the table's own pick (tests/gpu/test_batch_invariant_cuda.py is the gate
for what the table holds). The JSON keeps `best_per_shape` (the fastest bitwise-equal candidate per
weight, W1-weighted: 128 decode steps per ~19 chunks of 4,096), which `end_to_end.py --matmul-tiles`
puts into MATMUL_TILES_BY_SHAPE (one tile for every M of that weight).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pagedkv.kernels.batch_invariant_triton import (  # noqa: E402
    MATMUL_BLOCK_K,
    MATMUL_TILE_CHOICES,
    MATMUL_TILES_BY_M,
    MatmulTiles,
    matmul_triton,
)
from pagedkv.kernels.common import by_size  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""llama3-8b's linear layers as (N, K): out features, in features."""
ROWS = (1, 16, 64, 128, 512, 4096)
"""M: decode steps of 1-128 requests, prefill chunks of 512 and 4,096 tokens."""
REFERENCE: MatmulTiles = by_size(MATMUL_TILES_BY_M, max(ROWS))
"""The tiles whose bits every candidate must reproduce: the table's pick for the largest M."""
CANDIDATES: list[MatmulTiles] = list(
    dict.fromkeys(
        [
            *MATMUL_TILE_CHOICES,
            (16, 64, 64, 4, 4),  # 16 and 32 rows: mma.sync rather than wgmma, whose smallest tile is 64 rows
            (32, 64, 64, 4, 4),
            (64, 32, 64, 4, 3),
            (64, 32, 64, 4, 4),
            (64, 64, 64, 4, 3),
            (64, 64, 64, 4, 4),
            (64, 128, 64, 4, 4),
            (128, 64, 64, 4, 4),
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
        ]
    )
)
W1_WEIGHTS = {128: 128, 4096: 19}
"""Calls per M in W1, roughly: the weighting of `best_per_shape`."""


def bench(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def bucket_rows() -> dict[int, list[int]]:
    """Bucket index in MATMUL_TILES_BY_M -> the M of ROWS that fall in it."""
    indexed = tuple((bound, i) for i, (bound, _) in enumerate(MATMUL_TILES_BY_M))
    buckets: dict[int, list[int]] = {i: [] for _, i in indexed}
    for m in ROWS:
        buckets[by_size(indexed, m)].append(m)
    return buckets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/batch_invariant_matmul.py needs a CUDA GPU")
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for name, (n, k) in SHAPES.items()}
    inputs = {name: torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
    reference = {name: matmul_triton(inputs[name], w, tiles=REFERENCE) for name, w in weights.items()}
    cublas = {
        name: {m: bench(functools.partial(torch.mm, inputs[name][:m], w.T)) for m in ROWS}
        for name, w in weights.items()
    }
    cublas_sum = {m: sum(c[m] for c in cublas.values()) for m in ROWS}
    rows: list[dict] = []
    for tiles in CANDIDATES:
        assert tiles[2] == MATMUL_BLOCK_K, f"candidate {tiles}: another BLOCK_K sums K in other chunks"
        row: dict = {"tiles": list(tiles)}
        try:
            row["us"] = {
                name: {m: bench(functools.partial(matmul_triton, inputs[name][:m], w, tiles=tiles)) for m in ROWS}
                for name, w in weights.items()
            }
            row["us_sum"] = {m: sum(u[m] for u in row["us"].values()) for m in ROWS}
            row["x_cublas"] = {m: cublas_sum[m] / row["us_sum"][m] for m in ROWS}
            # Every row of every M against the same row of the reference's 4,096-row call.
            row["same_bits"] = all(
                torch.equal(matmul_triton(inputs[name][:m], w, tiles=tiles), reference[name][:m])
                for name, w in weights.items()
                for m in ROWS
            )
        except Exception as exc:  # noqa: BLE001  (a config that does not compile: say so, go on)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    ok = [r for r in rows if "error" not in r]
    print(f"\nmicroseconds over the four shapes (x cuBLAS); reference tiles {list(REFERENCE)}")
    print(f"{'tiles (BM, BN, BK, warps, stages)':<34}" + "".join(f"{'M=' + str(m):>15}" for m in ROWS) + "  same bits")
    print(f"{'cuBLAS (torch.mm)':<34}" + "".join(f"{cublas_sum[m]:15.0f}" for m in ROWS))
    for r in rows:
        if "error" in r:
            print(f"{str(r['tiles']):<34}{r['error']}")
            continue
        cells = "".join(f"{r['us_sum'][m]:8.0f} ({r['x_cublas'][m]:.2f})" for m in ROWS)
        print(f"{str(r['tiles']):<34}{cells}  {r['same_bits']}")

    print(f"\n{'bucket of MATMUL_TILES_BY_M':<30}{'M timed':<14}{'table pick (us)':<30}{'fastest bitwise-equal (us)'}")
    best_per_bucket = []
    for i, ms in bucket_rows().items():
        bound, pick = MATMUL_TILES_BY_M[i]
        label = f"M <= {bound}" if bound is not None else "larger M"
        if not ms:
            continue
        cost = {tuple(r["tiles"]): sum(r["us_sum"][m] for m in ms) for r in ok}
        fastest = min((r for r in ok if r["same_bits"]), key=lambda r: cost[tuple(r["tiles"])], default=None)
        entry = {"bucket": label, "rows": ms, "table_tiles": list(pick), "table_us": cost.get(pick)}
        if fastest is not None:
            entry |= {"fastest_tiles": fastest["tiles"], "fastest_us": cost[tuple(fastest["tiles"])]}
        best_per_bucket.append(entry)
        table = f"{list(pick)} {cost.get(pick, float('nan')):.0f}"
        best = f"{fastest['tiles']} {cost[tuple(fastest['tiles'])]:.0f}" if fastest else "none"
        print(f"{label:<30}{str(ms):<14}{table:<30}{best}")

    # One tile for every M of a weight (MATMUL_TILES_BY_SHAPE), as end_to_end.py --matmul-tiles reads it.
    best_per_shape = {}
    for name, nk in SHAPES.items():
        top = min(
            (r for r in ok if r["same_bits"]),
            key=lambda r: sum(w * r["us"][name][m] for m, w in W1_WEIGHTS.items()),  # noqa: B023
            default=None,
        )
        if top is not None:
            best_per_shape[name] = {"shape": list(nk), "tiles": top["tiles"], "us": top["us"][name]}
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "reference_tiles": list(REFERENCE),
                    "cublas_us": cublas,
                    "rows": rows,
                    "best_per_bucket": best_per_bucket,
                    "best_per_shape": best_per_shape,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
