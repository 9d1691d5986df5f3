"""Where a decode step's time goes: torch.profiler over a few steps of a live engine, as a small record.

    llm = LLM("tiny")
    profile = profile_decode(llm, batch=8, steps=6, async_scheduling=False)
    profile.host[:3]        # HostRange(phase="schedule", step=12, start=0.0, end=41.5, thread=0), ...
    profile.device[:3]      # DeviceRange(name=..., step=12, phase="forward", start=..., end=..., count=...)
    profile.summary         # per step: each host phase, the device busy and idle, the top kernels
    save_profiles("run.json", [profile, ...]); load_profiles("run.json")   # a GPU run, read on a laptop

The engine opens a profiler range around each phase of a step (pagedkv/ranges.py: schedule,
prepare, forward, sample, wait, book, each named with the step it belongs to). The profiler's
trace (Chrome trace JSON, as `torch.profiler.profile.export_chrome_trace` writes it) is reduced to
two lanes:

- host: the phase ranges, per thread, with the step each belongs to;
- device: on CUDA the kernels (and copies), each given the step and phase whose host range
  launched it (a kernel and the runtime call that launched it share a correlation id); on a CPU
  the top-level aten operators, which are the "device" work there. Intervals of one step and
  phase closer than `merge_gap_us` are merged into one (`count` says how many): a CUDA graph runs
  hundreds of kernels a step back to back, and a timeline cannot show them one by one anyway.

Times are microseconds from the start of the first profiled `LLM.step()` call. The summary is
worked out from the unmerged intervals. vLLM's `Worker.profile` (vllm/v1/worker/gpu_worker.py,
started and stopped by `LLM.start_profile()` / `stop_profile()`) writes whole traces; this record
keeps only what a timeline of a few steps needs.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.ranges import PHASES, PREFIX, STEP_RANGE

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

PROFILE_FORMAT = "pagedkv-profile"
PROFILE_VERSION = 1
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of work on a CUDA device."""
COMPUTE_PHASES = ("prepare", "forward", "sample")
"""The phases whose operators are a CPU's "device" work."""
LAUNCH_EVENTS = ("cuda_runtime", "cuda_driver")
HOST_RANGE_EVENTS = "user_annotation"
"""The category of a `record_function` range on the thread that opened it."""
"""Categories of the host calls that put that work on the device (cudaLaunchKernel, cudaGraphLaunch...)."""


@dataclass(frozen=True)
class HostRange:
    """One phase of one engine step on the host: from `start` to `end` (us) on thread `thread`."""

    phase: str
    step: int | None
    """The engine's number of the step it belongs to (None: before any step was scheduled)."""
    start: float
    end: float
    thread: int
    """0 for the first thread seen in the trace, 1 for the next, ..."""


@dataclass(frozen=True)
class DeviceRange:
    """Work on the device (kernels, or aten operators on a CPU) of one step, launched in one phase."""

    name: str
    """The kernel or operator (of merged ones, the longest)."""
    step: int | None
    phase: str | None
    """The host phase whose range launched it (None: launched outside the engine's ranges)."""
    start: float
    end: float
    count: int = 1
    """How many kernels or operators this interval merges (closer than `merge_gap_us` apart)."""


@dataclass(frozen=True)
class ProfileSummary:
    """Where one step's time goes, averaged over the profiled `LLM.step()` calls (us per step)."""

    step_us: float
    """Wall time per call: the profiled window over the number of calls."""
    host_us: dict[str, float]
    """Per phase, the host time spent in it."""
    host_other_us: float
    """Host time in no phase range: Python between the phases, the engine's own loop."""
    device_busy_us: float
    """Time the device ran at least one kernel (operator, on a CPU)."""
    device_idle_us: float
    """step_us - device_busy_us: the device waited (for the host, on a GPU)."""
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)
    """(name, us per step, launches per step) of the kernels (operators) taking the most time."""


@dataclass
class StepProfile:
    """A few engine steps under torch.profiler, reduced to a host lane, a device lane and a summary."""

    device_kind: str
    """"cuda": the device lane holds GPU kernels; "cpu": it holds the aten operators."""
    device_name: str
    model: str
    batch: int
    """Requests decoding in each profiled step."""
    async_scheduling: bool
    calls: list[tuple[float, float]]
    """(start, end) of each profiled `LLM.step()` call."""
    host: list[HostRange]
    device: list[DeviceRange]
    summary: ProfileSummary
    note: str = ""
    """Where and how it was recorded (card, date, torch version, CUDA graph mode)."""

    def steps(self) -> list[int]:
        """The numbers of the steps whose phases all ran in the profiled calls, in order."""
        phases: dict[int, set[str]] = defaultdict(set)
        for r in self.host:
            if r.step is not None:
                phases[r.step].add(r.phase)
        return sorted(s for s, seen in phases.items() if {"schedule", "forward", "book"} <= seen)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the lanes as rows (lists), so that a few thousand intervals stay small."""
        data = asdict(self)
        data["host"] = [[r.phase, r.step, r.start, r.end, r.thread] for r in self.host]
        data["device"] = [[r.name, r.step, r.phase, r.start, r.end, r.count] for r in self.device]
        data["columns"] = {"host": list(HostRange.__annotations__), "device": list(DeviceRange.__annotations__)}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        fields = {k: v for k, v in data.items() if k != "columns"}
        summary = dict(fields.pop("summary"))
        summary["top_kernels"] = [tuple(k) for k in summary["top_kernels"]]
        return cls(
            **{
                **fields,
                "calls": [tuple(c) for c in fields["calls"]],
                "host": [HostRange(*row) for row in fields["host"]],
                "device": [DeviceRange(*row) for row in fields["device"]],
                "summary": ProfileSummary(**summary),
            }
        )


def save_profiles(path: str | Path, profiles: list[StepProfile]) -> Path:
    """Write profiles (e.g. async scheduling off and on) to one JSON file."""
    path = Path(path)
    payload = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "profiles": [p.to_dict() for p in profiles],
    }
    path.write_text(json.dumps(payload, separators=(",", ":")))
    return path


def load_profiles(path: str | Path) -> list[StepProfile]:
    """The profiles saved in `path`; a file that is not such a file is a ValueError naming it."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        if payload.get("format") != PROFILE_FORMAT or payload.get("version") != PROFILE_VERSION:
            raise ValueError(f"format={payload.get('format')!r}, version={payload.get('version')!r}")
        return [StepProfile.from_dict(p) for p in payload["profiles"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is not a readable {PROFILE_FORMAT} v{PROFILE_VERSION} file: {type(exc).__name__}: {exc}"
        ) from None


# ---- profiling a live engine -----------------------------------------------------------


def profile_decode(
    llm: LLM,
    *,
    batch: int = 8,
    prompt_len: int = 32,
    steps: int = 6,
    warmup: int = 3,
    async_scheduling: bool | None = None,
    merge_gap_us: float = 2.0,
    seed: int = 0,
) -> StepProfile:
    """Profile `steps` calls of `llm.step()` while `batch` requests decode, and reduce the trace.

    The engine must be idle. `batch` requests of `prompt_len` random tokens are added and stepped
    until every prompt is in the KV cache, then `warmup` more steps (the first decode steps may
    compile or capture), then `steps` steps are profiled; the requests are aborted after it.
    `async_scheduling` (None: the engine's own setting) is the engine's switch for the length of
    the run: the same engine, and the same compiled model, profiled both ways.
    """
    if llm.has_unfinished_requests():
        raise ValueError("profile_decode needs an idle engine: step or abort its requests first.")
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2 * (steps + warmup) + 4, ignore_eos=True)
    previous = llm.async_scheduling
    ids: list[str] = []
    try:  # from here on, an interrupt (or an error) still aborts what was added and restores the switch
        if async_scheduling is not None:
            llm.async_scheduling = async_scheduling
        for _ in range(batch):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            ids.append(llm.add_request({"prompt_token_ids": prompt}, params))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in _requests(llm, ids)):
            llm.step()
        for _ in range(warmup):
            llm.step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        cuda = llm.runner.device.type == "cuda"
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(llm.runner.device)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(steps):
                llm.step()
            if cuda:
                torch.cuda.synchronize(llm.runner.device)
        events = _chrome_events(profiler)
        effective_async = llm.async_scheduling and not llm._listeners
    finally:
        for request_id in ids:
            llm.abort_request(request_id)
        while llm.has_unfinished_requests():  # outputs of a step whose listener raised
            llm.step()
        llm.async_scheduling = previous
    device_name = torch.cuda.get_device_name(llm.runner.device) if cuda else "cpu"
    return reduce_trace(
        events,
        device_kind="cuda" if cuda else "cpu",
        device_name=device_name,
        model=llm.config.model_config.model,
        batch=batch,
        async_scheduling=effective_async,
        merge_gap_us=merge_gap_us,
        note=f"torch {torch.__version__}",
    )


def _requests(llm: LLM, ids: list[str]) -> list[Any]:
    """The unfinished requests among `ids` (the engine's records)."""
    return [llm._requests[i] for i in ids if i in llm._requests]


def _chrome_events(profiler: torch.profiler.profile) -> list[dict[str, Any]]:
    """The profiler's events as Chrome-trace dicts (the one export torch offers with correlation ids)."""
    handle, name = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(name)
        return json.loads(Path(name).read_text())["traceEvents"]
    finally:
        os.unlink(name)


# ---- reducing a Chrome trace ---------------------------------------------------------------


def reduce_trace(
    events: list[dict[str, Any]],
    *,
    device_kind: str,
    device_name: str,
    model: str,
    batch: int,
    async_scheduling: bool,
    merge_gap_us: float = 2.0,
    note: str = "",
) -> StepProfile:
    """A `StepProfile` from Chrome-trace events of the engine's ranges (see the module docstring)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # On CUDA each range shows twice: on its host thread (user_annotation) and as the span of the GPU
    # work it launched (gpu_user_annotation, on a stream): the host's is the range.
    annotations = [e for e in complete if e.get("cat") == HOST_RANGE_EVENTS]
    calls_raw = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in annotations if e["name"] == STEP_RANGE
    )
    if not calls_raw:
        raise ValueError(f"No {STEP_RANGE!r} range in the trace: was LLM.step() called under the profiler?")
    t0, t1 = calls_raw[0][0], calls_raw[-1][1]
    threads: dict[Any, int] = {}
    host = _host_ranges(annotations, threads)
    if device_kind == "cuda":
        raw = _cuda_work(complete, host, threads)
    else:
        raw = _cpu_work(complete, host, threads)
    raw = [r for r in raw if (r.end > t0 and r.start < t1) or r.step is not None]
    host = [h for h in host if h.start >= t0 and h.end <= t1]
    summary = _summarize(host, raw, calls_raw, t0)

    def shift(x: float) -> float:
        return round(x - t0, 1)

    return StepProfile(
        device_kind=device_kind,
        device_name=device_name,
        model=model,
        batch=batch,
        async_scheduling=async_scheduling,
        calls=[(shift(a), shift(b)) for a, b in calls_raw],
        host=[HostRange(h.phase, h.step, shift(h.start), shift(h.end), h.thread) for h in host],
        device=[
            DeviceRange(d.name, d.step, d.phase, shift(d.start), shift(d.end), d.count)
            for d in _merge(raw, merge_gap_us)
        ],
        summary=summary,
        note=note,
    )


def _host_ranges(events: list[dict[str, Any]], threads: dict[Any, int]) -> list[HostRange]:
    """The engine's phase ranges, sorted by start; the runner's (no step in their name) take the
    step of the last schedule range before them on their thread."""
    found = []
    for e in sorted(events, key=lambda e: float(e["ts"])):
        name = e["name"]
        if not name.startswith(PREFIX) or name == STEP_RANGE:
            continue
        phase, _, number = name[len(PREFIX) :].partition("#")
        if phase not in PHASES:
            continue
        thread = threads.setdefault(e["tid"], len(threads))
        start = float(e["ts"])
        found.append((phase, int(number) if number else None, start, start + float(e["dur"]), thread))
    last_scheduled: dict[int, int] = {}
    host = []
    for phase, step, start, end, thread in found:
        if phase == "schedule" and step is not None:
            last_scheduled[thread] = step
        elif step is None:
            step = last_scheduled.get(thread)
        host.append(HostRange(phase, step, start, end, thread))
    return host


def _owner(host: list[HostRange], thread: int, t: float) -> tuple[int | None, str | None]:
    """(step, phase) of the innermost (latest-starting) host range on `thread` that holds time `t`;
    outside every range, the step of the last range before `t` on that thread, and no phase (the
    sampled tokens' copy to the host, say, is started between two ranges)."""
    inside = [h for h in host if h.thread == thread and h.start <= t <= h.end]
    if inside:
        h = max(inside, key=lambda h: h.start)
        return h.step, h.phase
    before = [h for h in host if h.thread == thread and h.end < t]
    return (max(before, key=lambda h: h.end).step, None) if before else (None, None)


def _cuda_work(events: list[dict[str, Any]], host: list[HostRange], threads: dict[Any, int]) -> list[DeviceRange]:
    """GPU kernels and copies, each with the step and phase of the host range that launched it."""
    launches = {
        e["args"]["correlation"]: (float(e["ts"]), e["tid"])
        for e in events
        if e.get("cat") in LAUNCH_EVENTS and "correlation" in e.get("args", {})
    }
    work = []
    for e in events:
        if e.get("cat") not in DEVICE_EVENTS:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        step, phase = None, None
        if launch is not None and launch[1] in threads:
            step, phase = _owner(host, threads[launch[1]], launch[0])
        start = float(e["ts"])
        work.append(DeviceRange(e["name"], step, phase, start, start + float(e["dur"])))
    return sorted(work, key=lambda d: d.start)


def _cpu_work(events: list[dict[str, Any]], host: list[HostRange], threads: dict[Any, int]) -> list[DeviceRange]:
    """On a CPU the operators are the device's work: the top-level aten operators (not those that
    run inside another one) of the phases that compute a step (prepare, forward, sample), each with
    that step and phase. Operators of wait and book read the results: host bookkeeping."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], float(e["ts"])))
    work = []
    covered_until: dict[Any, float] = {}
    for e in ops:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if start < covered_until.get(e["tid"], float("-inf")):
            continue  # inside the operator before it
        covered_until[e["tid"]] = end
        thread = threads.get(e["tid"])
        step, phase = _owner(host, thread, start) if thread is not None else (None, None)
        if phase in COMPUTE_PHASES:
            work.append(DeviceRange(e["name"], step, phase, start, end))
    return sorted(work, key=lambda d: d.start)


def _merge(work: list[DeviceRange], gap_us: float) -> list[DeviceRange]:
    """Neighbours of one step and phase less than `gap_us` apart, as one interval named by the longest."""
    merged: list[DeviceRange] = []
    longest: list[float] = []
    for d in work:
        last = merged[-1] if merged else None
        if last is not None and (last.step, last.phase) == (d.step, d.phase) and d.start - last.end < gap_us:
            name = d.name if d.end - d.start > longest[-1] else last.name
            longest[-1] = max(longest[-1], d.end - d.start)
            merged[-1] = DeviceRange(name, d.step, d.phase, last.start, max(last.end, d.end), last.count + d.count)
        else:
            merged.append(d)
            longest.append(d.end - d.start)
    return merged


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _summarize(
    host: list[HostRange], work: list[DeviceRange], calls: list[tuple[float, float]], t0: float
) -> ProfileSummary:
    n = len(calls)
    window = calls[-1][1] - t0
    per_phase = dict.fromkeys(PHASES, 0.0)
    for h in host:
        per_phase[h.phase] += h.end - h.start
    inside = [(max(d.start, t0), min(d.end, calls[-1][1])) for d in work if d.end > t0 and d.start < calls[-1][1]]
    busy = busy_time(inside)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for d in work:
        kernels[d.name][0] += d.end - d.start
        kernels[d.name][1] += d.count
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:5]
    in_phases = busy_time([(h.start, h.end) for h in host])
    return ProfileSummary(
        step_us=round(window / n, 1),
        host_us={p: round(v / n, 1) for p, v in per_phase.items()},
        host_other_us=round((window - in_phases) / n, 1),
        device_busy_us=round(busy / n, 1),
        device_idle_us=round((window - busy) / n, 1),
        top_kernels=[(name, round(us / n, 1), round(count / n, 1)) for name, (us, count) in top],
    )


def idle_gaps(profile: StepProfile) -> dict[int, float]:
    """Per profiled step after the first, how long the device sat idle between the previous step's
    last device work and this step's first (us; 0 when they touch or overlap)."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for d in profile.device:
        if d.step is None:
            continue
        first[d.step] = min(first.get(d.step, d.start), d.start)
        last[d.step] = max(last.get(d.step, d.end), d.end)
    steps = sorted(first)
    return {s: round(max(0.0, first[s] - last[p]), 1) for p, s in zip(steps, steps[1:]) if s - p == 1}


__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "DeviceRange",
    "HostRange",
    "ProfileSummary",
    "StepProfile",
    "busy_time",
    "idle_gaps",
    "load_profiles",
    "profile_decode",
    "reduce_trace",
    "save_profiles",
]
