"""Host time of one kernel call: the Python and launch work before the GPU sees anything.

    python benchmarks/kernel_launch_overhead.py [--calls 100] [--profile] [--json out.json]

Called eagerly (outside a CUDA graph), every layer pays its kernels' launch path on the host
each step: argument checks, the launch configuration, Triton's argument binding and
specialisation, the driver call. This times that path alone: rounds of `--calls` calls with
no synchronisation inside a round (few enough that the GPU's launch queue never fills, so the
host never waits for the GPU), host clock per round / calls, median over rounds.

Cases: `unified_attention` decode at 1x4096 (bf16, 32/8 heads, head 128, block size 16) with
the launch config chosen per call (the kernel API alone) and precomputed once per step (as
the TRITON_ATTN backend calls it), a W1-like 128x1024 decode, `reshape_and_cache` of one token;
peers: flash-attn 4 (when importable), dense SDPA, an empty Triton kernel, one small torch op.
`--profile` prints cProfile's top entries over the engine-style 1x4096 call.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: lets an older checkout be timed

from llama_batch import DTYPE, HKV, HQ, D, batch_config, llama_batch  # noqa: E402
from pagedkv.kernels import SplitKVWorkspace, reshape_and_cache, unified_attention  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    pass


def host_us(fn: Callable[[], object], calls: int, rounds: int = 30) -> float:
    """Median host microseconds per call over `rounds` rounds of `calls` unsynchronised calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def attention_call(batch: PagedBatch, *, precomputed: bool) -> Callable[[], object]:
    out = torch.empty_like(batch.q)
    kwargs = batch.attention_kwargs()
    workspace = SplitKVWorkspace(batch.q.shape[0] * 64, HQ, D, "cuda")
    config = batch_config(batch) if precomputed else None  # what the backend's metadata builder does once per step
    k_cache, v_cache = batch.k_cache, batch.v_cache
    return lambda: unified_attention(batch.q, k_cache, v_cache, out, **kwargs, workspace=workspace, config=config)


def cases() -> dict[str, Callable[[], object]]:
    one = llama_batch([1], [4095])
    w1 = llama_batch([1] * 128, [1023] * 128, seed=1)
    key = torch.randn(1, HKV, D, dtype=DTYPE, device="cuda")
    slot = torch.tensor([5], dtype=torch.int64, device="cuda")
    out = {
        "unified_attention 1x4096 (config per call)": attention_call(one, precomputed=False),
        "unified_attention 1x4096 (engine: config per step)": attention_call(one, precomputed=True),
        "unified_attention 128x1024 (engine: config per step)": attention_call(w1, precomputed=True),
        "reshape_and_cache 1 token": lambda: reshape_and_cache(key, key, one.k_cache, one.v_cache, slot),
    }
    try:
        from flash_attn.cute import flash_attn_varlen_func

        out["flash-attn 4 1x4096"] = lambda: flash_attn_varlen_func(
            one.q,
            one.k_cache,
            one.v_cache,
            cu_seqlens_q=one.query_start_loc,
            seqused_k=one.seq_lens,
            max_seqlen_q=1,
            max_seqlen_k=4096,
            page_table=one.block_table,
            causal=True,
            softmax_scale=D**-0.5,
        )
    except ImportError:
        pass
    dq = torch.randn(1, HKV, HQ // HKV, D, dtype=DTYPE, device="cuda")
    dk = torch.randn(1, HKV, 4096, D, dtype=DTYPE, device="cuda")
    out["dense SDPA 1x4096"] = lambda: F.scaled_dot_product_attention(dq, dk, dk)
    out["empty Triton kernel (1 argument)"] = lambda: _empty_kernel[(1,)](key)
    out["torch.add (one small op)"] = lambda: torch.add(key, key)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100, help="calls per round (keep the launch queue short)")
    parser.add_argument("--profile", action="store_true", help="cProfile the engine-style 1x4096 call")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_launch_overhead.py needs a CUDA GPU")
    rows = []
    for name, fn in cases().items():
        try:
            rows.append({"case": name, "host_us": host_us(fn, args.calls)})
        except Exception as exc:  # a peer that cannot run here says why
            rows.append({"case": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"})
    print(f"\nhost time per call (median of rounds of {args.calls} unsynchronised calls)")
    for r in rows:
        print(f"  {r['case']:<52}{r['host_us']:9.1f} us" if "error" not in r else f"  {r['case']:<52} {r['error']}")
    if args.profile:
        fn = cases()["unified_attention 1x4096 (engine: config per step)"]
        fn()
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [fn() for _ in range(2000)])
        torch.cuda.synchronize()
        print("\ncProfile of 2000 engine-style 1x4096 calls (tottime, top 15):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
