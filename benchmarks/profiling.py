"""Where an engine's time goes: cProfile with compile counters, and the GPU kernels under torch.profiler.

* `profiled(fn)`: cProfile over a call; prints its top entries and how much of it was compilation
  (Triton's `compile`, Dynamo's frame compilation, Python's `compile` builtin, SHA-256 hashings).
* `kernel_profile(fn)`: torch.profiler over a call; prints the kernels taking the most GPU time.
* `gpu_kernel_seconds(fn)`: the GPU time of the kernels (and copies) a call runs, summed.

Once the profiler has run in a process, CUDA-graph timings after it read slightly slower
(~0.3 us a kernel, benchmarks/README.md): callers profile after their timed runs.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable

import torch

import engine_bench


def profiled(fn: Callable[[], object], top: int, title: str) -> dict[str, float]:
    """Run `fn` under cProfile; print its top entries; return compile counters and the wall time."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(fn)
    engine_bench.sync()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    found = compile_counters(stats)
    found["wall_s"] = wall
    compiling = found["triton_compile_s"] + found["dynamo_compile_s"] + found["builtins_compile_s"]
    found["compile_share_upper"] = compiling / wall  # an upper bound: nested compile calls count twice
    print(f"\n--- {title}: {wall:.2f} s under cProfile; " + ", ".join(f"{k} {v:.3g}" for k, v in found.items()))
    stats.sort_stats("tottime").print_stats(top)
    if found["builtins_compile_calls"]:
        stats.print_callers("builtins.compile")
    return found


def compile_counters(stats: pstats.Stats) -> dict[str, float]:
    """Calls and seconds of the compilation entry points, from cProfile's table."""
    out = dict.fromkeys(
        (
            "triton_compile_calls",
            "triton_compile_s",
            "dynamo_compile_calls",
            "dynamo_compile_s",
            "builtins_compile_calls",
            "builtins_compile_s",
            "sha256_calls",
        ),
        0.0,
    )
    for (file, _, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if file.endswith("triton/compiler/compiler.py") and func == "compile":
            out["triton_compile_calls"] += calls
            out["triton_compile_s"] += cumtime
        elif file.endswith("torch/_dynamo/convert_frame.py") and func == "_compile":
            out["dynamo_compile_calls"] += calls
            out["dynamo_compile_s"] += cumtime
        elif func == "<built-in method builtins.compile>":
            out["builtins_compile_calls"] += calls
            out["builtins_compile_s"] += tottime
        elif "sha256" in func:
            out["sha256_calls"] += calls
    return out


def _device_events(fn: Callable[[], object], cpu_too: bool) -> tuple[list, float]:
    """The profiler's per-kernel averages of a call on the GPU (device events only), and its wall time."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if cpu_too:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA], wall


def gpu_kernel_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """GPU time of every kernel, copy and memset that `fn` runs (summed), and the wall time of the call.

    Kernels inside CUDA graphs are counted one by one (CUPTI records graph nodes). Only device
    activity is traced, so the host side runs nearly as fast as without the profiler.
    """
    events, wall = _device_events(fn, cpu_too=False)
    return sum(e.self_device_time_total for e in events) / 1e6, wall


def kernel_profile(fn: Callable[[], object], top: int, title: str) -> dict[str, float]:
    """Run `fn` under torch.profiler; print the GPU kernels that take the most time.

    Returns the GPU time summed over kernels and the wall time: a sum well below the wall time
    means the GPU waited for the host.
    """
    events, wall = _device_events(fn, cpu_too=True)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    gpu_s = sum(e.self_device_time_total for e in events) / 1e6
    print(f"\n--- {title}, kernels: {gpu_s:.2f} s of GPU time in {wall:.2f} s of wall time (under the profiler)")
    for e in events[:top]:
        print(f"  {e.self_device_time_total / 1e3:10.1f} ms {e.count:7d}x  {e.key[:110]}")
    return {"gpu_s": gpu_s, "wall_s": wall}
