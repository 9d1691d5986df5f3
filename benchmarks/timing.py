"""GPU timing helpers: event timing with L2 flushes, CUDA-graph timing over rotating inputs.

Two numbers per kernel, as the benchmarks report them:

* `bench_us`: `triton.testing.do_bench` (median; L2 flushed before every call, host launch
  overhead included).
* `graph_us`: GPU time inside one CUDA graph of many calls (median of replays / calls). The
  calls rotate over several copies of the inputs so that a problem smaller than the 60 MB L2
  is not timed from the cache.
* `graph1_us`: a graph of a single call, replayed back to back (median over replays). Some
  kernels capture alone but not many to a graph; comparisons with them use this number for
  both sides.
* `kernel_us`: the summed duration of the kernels one call launches, read from the profiler's
  device-side records (CUPTI). GPU time without launch gaps, like a graph, for kernels that
  cannot be captured at all (flash-attn 4 b36 inside this benchmark).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
import triton.testing

L2_BYTES = 60 * 2**20  # H200


def copies_for(bytes_per_copy: int, limit: int = 16) -> int:
    """How many input copies to rotate over so the working set is ~4x the L2."""
    return max(1, min(limit, -(-4 * L2_BYTES // max(bytes_per_copy, 1))))


def bench_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _replays_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU milliseconds of `replays` back-to-back replays of `graph`, between two events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def graph_us(fns: Sequence[Callable[[], object]], rep_ms: float = 30.0) -> float:
    """Median GPU time of one call, from replays of a graph that cycles through `fns`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(10):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 10, 1e-3)
        calls = max(len(fns), min(2000, int(rep_ms / estimate_ms)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
        torch.cuda.synchronize()
        times = [_replays_ms(graph, 1) / calls for _ in range(7)]
    del graph
    return statistics.median(times) * 1e3


def graph1_us(fn: Callable[[], object], rep_ms: float = 30.0) -> float:
    """Median GPU time of one call captured alone and replayed many times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    replays = max(5, min(2000, int(rep_ms / max(_replays_ms(graph, 5) / 5, 1e-3))))
    times = [_replays_ms(graph, replays) / replays for _ in range(5)]
    del graph
    return statistics.median(times) * 1e3


def kernel_us(fns: Sequence[Callable[[], object]], calls: int = 10) -> float:
    """Mean GPU kernel time of one call, cycling over `fns`, from the profiler's device records."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    # Only device activity is recorded, so every event is a kernel, memcpy or memset.
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for a scatter."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9
