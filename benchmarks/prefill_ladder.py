"""The prefill ladder, measured: TFLOP/s of every rung of pagedkv/kernels/prefill_ladder.py beside
dense `F.scaled_dot_product_attention(is_causal=True)`, in one run (notebook 15 plots the JSON).

    python benchmarks/prefill_ladder.py [--json PATH] [--tokens 1024 4096 8192]   # a CUDA GPU, ~1 min
    python benchmarks/prefill_ladder.py --cpu-check                               # no GPU: tiny shapes

On a GPU: bf16, one sequence of T tokens, 32 heads of 128, causal. Each kernel is timed with
`triton.testing.do_bench` (median; L2 flushed before each call) and its output compared with SDPA's.
TFLOP/s count the useful work only (`causal_flops`: the masked half of QK^T and PV left out), so a
rung that computes masked tiles anyway shows it as a lower rate. A rung that does not compile (or
fails) is recorded with its message and the run goes on. The JSON (default
notebooks/traces/prefill_ladder_h100.json, what the notebook reads) holds the card, the versions,
the date, the command and, per kernel and T, the time, TFLOP/s, ratio to SDPA and error, or the
error message. `--cpu-check` runs every rung under Triton's interpreter on tiny shapes against a
float64 reference instead (no timing; writes JSON only with --json) and exits 1 if one is off.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # run from a checkout without installing

DEFAULT_JSON = REPO / "notebooks" / "traces" / "prefill_ladder_h100.json"
NUM_HEADS, HEAD_DIM = 32, 128
CPU_SHAPES = [(40, 2, 16), (33, 2, 32)]
"""(tokens, heads, head_dim) of --cpu-check: lengths that are not a multiple of the 16-row tiles."""
CPU_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
"""Max |error| against float64; bf16: its output rounding (2^-8 relative) and P rounded for its dot."""


def gist(exc: BaseException) -> str:
    """An error in a few hundred characters: Triton's compile errors end with the reason."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[-3:])}"[:400]


def cpu_check(rungs: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """Every rung on CPU_SHAPES in float32 and bfloat16, under the interpreter: rows, and whether all passed."""
    from pagedkv.kernels.prefill_ladder import reference

    rows, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, heads, head_dim in CPU_SHAPES:
            gen = torch.Generator().manual_seed(tokens)
            q, k, v = (torch.randn(tokens, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
            expected = reference(q, k, v)
            for name, rung in rungs.items():
                row: dict[str, Any] = dict(kernel=name, dtype=str(dtype)[6:], tokens=tokens, heads=heads)
                try:
                    row["max_error"] = (rung(q, k, v).double() - expected).abs().max().item()
                    row["ok"] = row["max_error"] <= CPU_TOLERANCE[dtype]
                except Exception as exc:  # noqa: BLE001  (a broken rung: say so, check the others)
                    row.update(error=gist(exc), ok=False)
                ok &= row["ok"]
                rows.append(row)
                shown = f"{row['max_error']:.1e}" if "max_error" in row else row["error"]
                print(f"{name:<18}{row['dtype']:<10}T={tokens:<4}D={head_dim:<4}max |error| {shown}", flush=True)
    return rows, ok


def calls(rungs: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Kernel name -> a call on these inputs returning [T, H, D]: SDPA first (on its own [1, H, T, D]
    layout, made contiguous outside the timing), then the rungs."""
    dense = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)]
    kernels = {"sdpa": lambda: F.scaled_dot_product_attention(*dense, is_causal=True)[0].transpose(0, 1)}
    kernels.update({name: functools.partial(rung, q, k, v) for name, rung in rungs.items()})
    return kernels


def gpu_run(rungs: dict[str, Any], token_counts: list[int]) -> list[dict[str, Any]]:
    """Every rung and SDPA at each T on the GPU: one row per (kernel, T)."""
    import triton.testing

    from pagedkv.kernels.prefill_ladder import causal_flops

    rows = []
    print(f"{'T':<8}{'kernel':<18}{'TFLOP/s':>8} {'x SDPA':>8}", flush=True)
    for tokens in token_counts:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        q, k, v = (
            torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)
        )
        kernels = calls(rungs, q, k, v)
        expected = kernels["sdpa"]().float()
        flops = causal_flops(tokens, NUM_HEADS, HEAD_DIM)
        for name, call in kernels.items():
            row: dict[str, Any] = {"kernel": name, "tokens": tokens}
            try:
                error = (call().float() - expected).abs().max().item()
                ms = triton.testing.do_bench(call, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9, max_error_vs_sdpa=error)
            except Exception as exc:  # noqa: BLE001  (a rung that does not compile here: record why)
                row["error"] = gist(exc)
            torch.cuda.empty_cache()  # the naive rung's scores: gigabytes at T = 8192
            rows.append(row)
        sdpa_ms = next(r["ms"] for r in rows if r["kernel"] == "sdpa" and r["tokens"] == tokens)
        for row in rows:
            if row["tokens"] == tokens and "ms" in row:
                row["x_sdpa"] = sdpa_ms / row["ms"]
            if row["tokens"] == tokens:
                shown = f"{row['tflops']:8.1f} {row['x_sdpa']:7.2f}x" if "ms" in row else "  " + row["error"]
                print(f"T={tokens:<6}{row['kernel']:<18}{shown}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        prog="prefill_ladder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", type=Path, help=f"where the results go (GPU default: {DEFAULT_JSON.relative_to(REPO)})")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192], help="sequence lengths (GPU)")
    p.add_argument("--cpu-check", action="store_true", help="tiny shapes under Triton's interpreter, no GPU needed")
    args = p.parse_args()
    if args.cpu_check:
        # Triton picks its interpreter when it is first imported, which has not happened yet.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("prefill_ladder: error: no CUDA GPU is visible; run it on a GPU, or pass --cpu-check")
    if any(t < 1 for t in args.tokens):
        sys.exit(f"prefill_ladder: error: --tokens must be positive, got {args.tokens}")
    from pagedkv.kernels.common import interpreter_problem
    from pagedkv.kernels.prefill_ladder import RUNGS

    if args.cpu_check and interpreter_problem():
        sys.exit(f"prefill_ladder: error: {interpreter_problem()}")
    import triton

    if args.cpu_check:
        rows, ok = cpu_check(RUNGS)
        card = f"CPU ({platform.machine()}), Triton's interpreter"
    else:
        rows, ok = gpu_run(RUNGS, args.tokens), True
        card = torch.cuda.get_device_name()
    path = args.json if args.json or args.cpu_check else DEFAULT_JSON
    if path is not None:
        result = {
            "card": card,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.date.today().isoformat(),
            "command": shlex.join(["python", *sys.argv]),
            "dtype": "float32 and bfloat16" if args.cpu_check else "bfloat16",
            "num_heads": NUM_HEADS,
            "head_dim": HEAD_DIM,
            "flops": "causal_flops: 4 * heads * T^2 * head_dim / 2 (the unmasked half of QK^T and PV)",
            "rows": rows,
        }
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    if not ok:
        sys.exit("prefill_ladder: error: a rung is off the float64 reference (see the rows above)")


if __name__ == "__main__":
    main()
