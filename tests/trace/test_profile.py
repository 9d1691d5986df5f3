"""The engine's phase ranges and their reduction to a profile: a hand-made CUDA trace reduced to the lanes
and numbers worked out by hand; a live tiny engine profiled with async scheduling off and on (phases in
order, step N+1 planned before step N is booked only with it on); no range costs a record_function while
no profiler runs; the record survives JSON; the GPU benchmark's CPU smoke run writes a loadable file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv import LLM
from pagedkv.ranges import PHASES, phase_range
from pagedkv.trace.profile import (
    DeviceRange,
    HostRange,
    StepProfile,
    busy_time,
    idle_gaps,
    load_profiles,
    profile_decode,
    reduce_trace,
    save_profiles,
)
from tests.conftest import smoke_run


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 7, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _cuda_trace() -> list[dict[str, Any]]:
    """One `LLM.step()` call at t = 1000 us under async scheduling: it plans and launches step 5 and
    books step 4. Three kernels of step 5's forward (two 1 us apart, one 10 us later) and one of its
    sampler; one of step 4, launched before the call, still running when it starts."""
    return [
        _x("pagedkv.step", 1000, 200),
        _x("pagedkv.schedule#5", 1010, 20),
        _x("pagedkv.prepare", 1040, 30),  # the runner's: no step in its name
        _x("pagedkv.forward", 1080, 40),
        _x("pagedkv.sample", 1125, 5),
        _x("pagedkv.sample#5", 1135, 10),
        _x("pagedkv.wait#4", 1150, 30),
        _x("pagedkv.book#4", 1182, 15),
        _x("pagedkv::unified_attention_with_output", 1090, 5, cat="cpu_op"),  # a custom op, not a phase
        _x("pagedkv.forward", 1090, 31, cat="gpu_user_annotation", tid=0),  # the range's GPU span: not a range
        _x("cudaGraphLaunch", 980, 4, cat="cuda_runtime", correlation=1),  # before the call: no range holds it
        _x("cudaLaunchKernel", 1085, 2, cat="cuda_runtime", correlation=2),
        _x("cudaLaunchKernel", 1090, 2, cat="cuda_runtime", correlation=3),
        _x("cudaLaunchKernel", 1100, 2, cat="cuda_runtime", correlation=4),
        _x("cudaLaunchKernel", 1140, 2, cat="cuda_runtime", correlation=5),
        _x("step4_gemm", 990, 30, cat="kernel", tid=0, correlation=1),
        _x("gemm_a", 1090, 10, cat="kernel", tid=0, correlation=2),
        _x("gemm_b", 1101, 20, cat="kernel", tid=0, correlation=3),
        _x("attention", 1131, 9, cat="kernel", tid=0, correlation=4),
        _x("argmax", 1160, 3, cat="kernel", tid=0, correlation=5),
    ]


def test_a_cuda_trace_reduces_to_the_lanes_worked_out_by_hand() -> None:
    p = reduce_trace(
        _cuda_trace(), device_kind="cuda", device_name="H", model="m", batch=2, async_scheduling=True, merge_gap_us=2
    )
    assert p.calls == [(0.0, 200.0)]
    assert [(h.phase, h.step, h.start, h.end) for h in p.host] == [
        ("schedule", 5, 10.0, 30.0),
        ("prepare", 5, 40.0, 70.0),  # numbered by the schedule before it
        ("forward", 5, 80.0, 120.0),
        ("sample", 5, 125.0, 130.0),
        ("sample", 5, 135.0, 145.0),
        ("wait", 4, 150.0, 180.0),
        ("book", 4, 182.0, 197.0),
    ]
    # step4_gemm: launched before any range, so neither step nor phase; gemm_a and gemm_b 1 us apart
    # merge (named by the longer), attention 10 us later does not; argmax was launched in sample#5.
    assert p.device == [
        DeviceRange("step4_gemm", None, None, -10.0, 20.0, 1),
        DeviceRange("gemm_b", 5, "forward", 90.0, 121.0, 2),
        DeviceRange("attention", 5, "forward", 131.0, 140.0, 1),
        DeviceRange("argmax", 5, "sample", 160.0, 163.0, 1),
    ]
    s = p.summary
    assert s.step_us == 200.0
    assert s.host_us == {"schedule": 20.0, "prepare": 30.0, "forward": 40.0, "sample": 15.0, "wait": 30.0, "book": 15.0}
    # in no phase: 0-10, 30-40, 70-80, 120-125, 130-135, 145-150, 180-182, 197-200 = 50 us
    assert s.host_other_us == 50.0
    # busy inside the call: 0-20 (step4_gemm clipped), 90-100, 101-121, 131-140, 160-163 = 62 us
    assert (s.device_busy_us, s.device_idle_us) == (62.0, 138.0)
    assert s.top_kernels[0] == ("step4_gemm", 30.0, 1.0)


def test_idle_gaps_and_busy_time_by_hand() -> None:
    assert busy_time([(5, 9), (0, 3), (2, 4), (8, 10)]) == 9  # 0-4 and 5-10
    device = [
        DeviceRange("a", 1, "forward", 0, 10),
        DeviceRange("b", 1, "sample", 30, 35),  # step 1 ends at 35, after b's neighbour c starts
        DeviceRange("c", 2, "forward", 12, 20),  # ... so step 2's first work (12) overlaps: gap 0
        DeviceRange("d", 3, "forward", 50, 60),
        DeviceRange("e", 5, "forward", 90, 95),  # no step 4 in the record: no gap for 5
    ]
    p = StepProfile("cuda", "H", "m", 1, False, [(0, 100)], [], device, _summary())
    assert idle_gaps(p) == {2: 0.0, 3: 30.0}


def _summary() -> Any:
    from pagedkv.trace.profile import ProfileSummary

    return ProfileSummary(1.0, dict.fromkeys(PHASES, 0.0), 0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def profiles() -> tuple[StepProfile, StepProfile, LLM]:
    torch.set_num_threads(1)
    llm = LLM("tiny", device="cpu", async_scheduling=False, num_kv_blocks=64)
    off = profile_decode(llm, batch=3, prompt_len=20, steps=4, warmup=1, async_scheduling=False)
    on = profile_decode(llm, batch=3, prompt_len=20, steps=4, warmup=1, async_scheduling=True)
    return off, on, llm


def _phases_of(p: StepProfile, step: int) -> dict[str, HostRange]:
    return {h.phase: h for h in p.host if h.step == step}  # the engine's sample range comes last


def test_live_profile_orders_the_phases_and_shows_the_overlap(profiles: tuple[StepProfile, StepProfile, LLM]) -> None:
    off, on, llm = profiles
    assert (off.async_scheduling, on.async_scheduling) == (False, True)
    assert not llm.has_unfinished_requests() and llm.async_scheduling is False  # left as it was
    for p in (off, on):
        assert len(p.calls) == 4 and p.device_kind == "cpu" and p.batch == 3
        assert len(p.steps()) >= 3
        for step in p.steps():
            ph = _phases_of(p, step)
            starts = [ph[name].start for name in PHASES]
            assert starts == sorted(starts), (step, ph)  # schedule, prepare, forward, sample, wait, book
            mine = [d for d in p.device if d.step == step]
            assert mine and all(d.phase in ("prepare", "forward", "sample") for d in mine)
            assert all(ph["prepare"].start <= d.start and d.end <= ph["sample"].end for d in mine)
    # Without async scheduling, step N is booked before step N+1 is planned; with it, after.
    for p, planned_first in ((off, False), (on, True)):
        for a, b in zip(p.steps(), p.steps()[1:]):
            assert (_phases_of(p, b)["schedule"].start < _phases_of(p, a)["book"].start) is planned_first
    s = off.summary
    assert s.host_us["forward"] > 0 and s.device_busy_us > 0
    assert s.device_busy_us + s.device_idle_us == pytest.approx(s.step_us, abs=0.2)
    assert sum(s.host_us.values()) + s.host_other_us == pytest.approx(s.step_us, abs=0.5)


def test_profiles_survive_json(profiles: tuple[StepProfile, StepProfile, LLM], tmp_path: Path) -> None:
    off, on, _ = profiles
    path = save_profiles(tmp_path / "p.json", [off, on])
    assert load_profiles(path) == [off, on]
    assert path.stat().st_size < 100_000
    (tmp_path / "bad.json").write_text(json.dumps({"format": "pagedkv-trace", "version": 1}))
    with pytest.raises(ValueError, match="bad.json is not a readable pagedkv-profile v1 file"):
        load_profiles(tmp_path / "bad.json")


def test_ranges_cost_no_record_function_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []

    class Counting(torch.profiler.record_function):
        def __init__(self, name: str, args: str | None = None) -> None:
            opened.append(name)
            super().__init__(name, args)

    monkeypatch.setattr(torch.profiler, "record_function", Counting)
    with phase_range("book", 3):
        pass
    assert opened == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with phase_range("book", 3):
            pass
    assert opened == ["pagedkv.book#3"]


def test_profile_decode_needs_an_idle_engine(profiles: tuple[StepProfile, StepProfile, LLM]) -> None:
    _, _, llm = profiles
    from pagedkv import SamplingParams

    request_id = llm.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="needs an idle engine"):
        profile_decode(llm)
    llm.abort_request(request_id)


def test_the_benchmark_smoke_run_writes_both_profiles(tmp_path: Path) -> None:
    out = smoke_run("profile_step.py", tmp_path / "meta.json", "--out", str(tmp_path / "cpu.json"))
    off, on = load_profiles(tmp_path / "cpu.json")
    assert (off.async_scheduling, on.async_scheduling) == (False, True)
    assert off.device_kind == "cpu" and out["out"] == str(tmp_path / "cpu.json")
