"""Timing single engine steps: decode step latency by batch, and the host / GPU split of a decode step.

* `decode_latency(llm, batch, ...)`: median wall time of `llm.step()` over steps that decode all
  `batch` requests (short random prompts; a step listener checks the batch, which makes the
  engine run one step at a time, i.e. without async scheduling's overlap).
* `decode_breakdown(llm, workload, steps)`: the workload's batch (its requests, other token ids,
  enough new tokens) stepped to pure decode; then `steps` steps timed on the wall clock (no
  listener, no profiler: async scheduling overlaps as in the timed runs), then `steps` more
  under torch.profiler, tracing the GPU only, whose kernel time per step is the GPU-busy time.
  Host share = 1 - GPU-busy / mean wall time. (CUDA events around a step would measure the GPU timeline's
  span, idle gaps included; the summed kernel time leaves the gaps out.) Under async scheduling
  a step window holds one launched-ahead step more or less: ~1/steps of error.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import replace

import engine_bench
from pagedkv import LLM, SamplingParams
from profiling import gpu_kernel_seconds
from workloads import Workload


def decode_latency(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median wall time of `llm.step()` over `steps` steps that decode all `batch` requests."""
    seen: list[tuple[int, int]] = []
    detach = llm.add_step_listener(lambda ev: seen.append((ev.result.batch.num_tokens, ev.result.batch.max_query_len)))
    rng = random.Random(batch)
    # Requests whose prompts finish early decode while later prompts are prefilled: room for that.
    budget = steps + 16 + batch * prompt_len // 1024
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    ids = [
        llm.add_request({"prompt_token_ids": [rng.randrange(3, 250) for _ in range(prompt_len)]}, params)
        for _ in range(batch)
    ]
    times: list[float] = []
    try:
        warm = 0
        while len(times) < steps:
            if len(seen) > budget:
                raise RuntimeError(f"batch {batch}: no {steps} pure decode steps in {budget} steps")
            start = time.perf_counter()
            llm.step()
            elapsed = time.perf_counter() - start
            if seen[-1] == (batch, 1):
                warm += 1
                if warm > 3:  # the first decode steps may still compile or capture
                    times.append(elapsed)
            elif warm:
                raise RuntimeError(f"batch {batch}: a step after decoding began was {seen[-1]}")
    finally:
        for req_id in ids:
            llm.abort_request(req_id)
        detach()
    return {"batch": batch, "step_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}


def decode_breakdown(llm: LLM, workload: Workload, steps: int) -> dict[str, float | int | None]:
    """Wall time vs GPU-busy time of pure decode steps at the workload's batch (see the module docstring).

    `workload` should hold prompts the engine has not cached, so that its prefill is a real one.
    """
    batch = len(workload.prompts)
    budget = workload.engine["max_num_batched_tokens"]
    prefill_steps = math.ceil(sum(map(len, workload.prompts)) / budget)  # type: ignore[operator]
    max_tokens = prefill_steps + 2 * steps + 16  # no request finishes before the last measured step
    ids = [
        llm.add_request({"prompt_token_ids": p}, replace(params, max_tokens=max_tokens))
        for p, params in zip(workload.prompts, workload.params, strict=True)
    ]

    def step() -> tuple[float, bool]:
        """One step's wall time, and whether it decoded every request and prefilled nothing."""
        prefill, decode = llm.stats.num_prefill_tokens, llm.stats.num_decode_tokens
        start = time.perf_counter()
        llm.step()
        wall = time.perf_counter() - start
        return wall, llm.stats.num_prefill_tokens == prefill and llm.stats.num_decode_tokens - decode == batch

    try:
        for _ in range(prefill_steps + 8):
            if step()[1]:
                break
        else:
            raise RuntimeError(f"no pure decode step of {batch} requests after {prefill_steps + 8} steps")
        for _ in range(2):  # settle: the step after the last prefill may still be launched behind it
            step()
        walls = [step() for _ in range(steps)]
        if not all(pure for _, pure in walls):
            raise RuntimeError("a measured step was not a pure decode of every request")
        gpu_ms = None
        if engine_bench.DEVICE == "cuda":
            engine_bench.sync()
            gpu_s, _ = gpu_kernel_seconds(lambda: [step() for _ in range(steps)])
            gpu_ms = gpu_s / steps * 1e3
    finally:
        for req_id in ids:
            llm.abort_request(req_id)
    mean_ms = statistics.mean(w for w, _ in walls) * 1e3  # the kernel time is a mean too
    return {
        "batch": batch,
        "steps": steps,
        "step_wall_ms": statistics.median(w for w, _ in walls) * 1e3,
        "mean_wall_ms": mean_ms,
        "gpu_busy_ms": gpu_ms,
        "host_share": None if gpu_ms is None else max(0.0, 1 - gpu_ms / mean_ms),
    }
