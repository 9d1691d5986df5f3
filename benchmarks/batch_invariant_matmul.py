"""The batch-invariant matmul's tile shape: candidates against cuBLAS on llama3-8b's linear layers (issue 35).

    python benchmarks/batch_invariant_matmul.py [--json out.json]      # H200, ~30 s

The batch-invariant mode (pagedkv/batch_invariant.py) runs every linear layer with ONE tile
shape, whatever the number of rows M: a decode step (M = the batch, 128 in W1) and a prefill chunk
(M = 4,096) must share it. Per candidate (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): microseconds per
layer shape at both M (`triton.testing.do_bench`, median), the sum over the four layer shapes, its
ratio to torch.mm (cuBLAS, which picks a kernel per shape) in the same run, and whether row 0 of
M = 1 equals row 0 of M = 4,096 bitwise (it must, for every candidate), and whether its output equals
that of the kept tiles bit for bit (the K loop runs in the same order; the MMA shapes differ): if
the hardware gives every tile shape the same bits, tiles could even follow M without breaking the mode. The table's last column
weighs the two sums as W1 does roughly: 128 decode steps per ~19 prefill chunks of 4,096 tokens.
A second table gives the best candidate per layer shape: the tiles may depend on the weight's
(N, K), never on M (`MATMUL_TILES_BY_SHAPE`; `end_to_end.py --matmul-tiles` tries them from the JSON).
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

from pagedkv.kernels.batch_invariant_triton import MATMUL_TILES, matmul_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""llama3-8b's linear layers as (N, K): out features, in features."""
CANDIDATES = [
    (64, 64, 64, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 32, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 32, 64, 4, 4),
    (128, 64, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (128, 64, 128, 4, 3),
    (128, 64, 64, 8, 4),
    MATMUL_TILES,  # (128, 128, 64, 8, 3): the winner of the H200 run of 2026-12-04
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (128, 256, 64, 8, 3),
]
ROWS = (128, 4096)
W1_WEIGHTS = {128: 128, 4096: 19}


def bench(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def shape_us(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, ...] | None) -> float:
    """Microseconds of x @ w.T: the candidate `tiles`, or torch.mm (None)."""
    return bench(
        functools.partial(torch.mm, x, w.T) if tiles is None else functools.partial(matmul_triton, x, w, tiles=tiles)
    )


def w1_ms(us: dict[int, float]) -> float:
    """The W1 weighting of one shape's (or a sum's) microseconds at each M."""
    return sum(W1_WEIGHTS[m] * us[m] for m in ROWS) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for name, (n, k) in SHAPES.items()}
    inputs = {
        (name, m): torch.randn(m, SHAPES[name][1], device="cuda", dtype=torch.bfloat16) for name in SHAPES for m in ROWS
    }
    cublas = {name: {m: shape_us(inputs[(name, m)], w, None) for m in ROWS} for name, w in weights.items()}
    rows: list[dict[str, object]] = []
    for tiles in CANDIDATES:
        row: dict[str, object] = {"tiles": list(tiles)}
        try:
            per_shape = {name: {m: shape_us(inputs[(name, m)], w, tiles) for m in ROWS} for name, w in weights.items()}
            row["us"] = per_shape
            for m in ROWS:
                row[f"us_m{m}"] = sum(t[m] for t in per_shape.values())
                row[f"x_cublas_m{m}"] = sum(c[m] for c in cublas.values()) / row[f"us_m{m}"]  # type: ignore[operator]
            row["w1_weighted_ms"] = w1_ms({m: row[f"us_m{m}"] for m in ROWS})  # type: ignore[misc]
            x, w = inputs[("o", 4096)], weights["o"]
            row["invariant"] = torch.equal(matmul_triton(x[:1], w, tiles=tiles), matmul_triton(x, w, tiles=tiles)[:1])
            # Whether the tile shape changes any bit at all.
            row["same_bits_as_kept"] = torch.equal(matmul_triton(x, w, tiles=tiles), matmul_triton(x, w))
        except Exception as exc:  # noqa: BLE001  (a config that does not compile: say so, go on)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    cublas_sum = {m: sum(c[m] for c in cublas.values()) for m in ROWS}
    print(
        f"\n{'tiles (BM, BN, BK, warps, stages)':<36}{'M=128 us':>10}{'x cuBLAS':>9}{'M=4096 us':>11}{'x cuBLAS':>9}{'W1 ms':>8}  invariant  same bits as kept"
    )
    print(
        f"{'cuBLAS (torch.mm)':<36}{cublas_sum[128]:10.0f}{'':>9}{cublas_sum[4096]:11.0f}{'':>9}{w1_ms(cublas_sum):8.1f}"
    )
    for r in rows:
        if "error" in r:
            print(f"{str(r['tiles']):<36}{r['error']}")
            continue
        print(
            f"{str(r['tiles']):<36}{r['us_m128']:10.0f}{r['x_cublas_m128']:9.2f}{r['us_m4096']:11.0f}"
            f"{r['x_cublas_m4096']:9.2f}{r['w1_weighted_ms']:8.1f}  {r['invariant']!s:<9}  {r['same_bits_as_kept']}"
        )
    # Tiles may depend on the weight's shape (N, K), never on M: the best candidate per shape.
    print(f"\n{'shape (N, K)':<22}{'best tiles by W1 weight':<28}{'M=128 x cuBLAS':>15}{'M=4096 x cuBLAS':>16}")
    best = {}
    for name, nk in SHAPES.items():
        top = min((r for r in rows if "error" not in r), key=lambda r: w1_ms(r["us"][name]))  # type: ignore[index]
        best[name] = {"shape": list(nk), "tiles": top["tiles"], "us": top["us"][name]}  # type: ignore[index]
        t = top["us"][name]  # type: ignore[index]
        print(
            f"{name + ' ' + str(nk):<22}{str(top['tiles']):<28}{cublas[name][128] / t[128]:15.2f}{cublas[name][4096] / t[4096]:16.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "cublas_us": cublas, "rows": rows, "best_per_shape": best},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
