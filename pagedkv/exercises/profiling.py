"""Checker for notebook 16 (profiling a step): read the device lane of a profile.

    check_idle_gap(fn)      fn(profile: StepProfile, step: int) -> float

`fn` returns how long the device sat idle between step `step - 1`'s last work and step `step`'s
first work, in us (0 when they touch or overlap): the time a GPU waits for the host between two
decode steps, which async scheduling is there to remove. The checker makes up profiles of its own
(integer times, so a right answer is exact) whose traps are the usual misreadings: a step's
longest kernel ends after the one listed last, the next step starts before the previous one ends,
device work of no step (launched before the profile began) sits in the lane, and the host lane's
ranges lie elsewhere. It calls `fn` on
every case, watched (pagedkv's own `idle_gaps` and `busy_time` are refused), and only then works
out the expected values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.exercises import CheckResult, call_on_cases, exercise, not_plain, package_answer, plain
from pagedkv.ranges import PHASES
from pagedkv.trace.profile import DeviceRange, HostRange, ProfileSummary, StepProfile, busy_time, idle_gaps

WHAT = "the device's idle time before a step"
PACKAGE: list[Callable[..., Any]] = [idle_gaps, busy_time]
HINT = (
    "take the device ranges of step - 1 and of step (profile.device, d.step); the gap is the first start "
    "of step minus the last END of step - 1 (the max over its ranges, not the one listed last), and 0 "
    "when that is negative."
)


def _profile(
    host: list[tuple[str, int, int, int]], device: list[tuple[str, int | None, str | None, int, int]]
) -> StepProfile:
    """A made-up GPU profile: host ranges (phase, step, start, end) on thread 0, device ranges as given."""
    summary = ProfileSummary(0.0, dict.fromkeys(PHASES, 0.0), 0.0, 0.0, 0.0)
    end = max(e for *_, e in host)
    return StepProfile(
        "cuda",
        "made up",
        "made up",
        4,
        False,
        [(0.0, float(end))],
        [HostRange(phase, step, float(s), float(e), 0) for phase, step, s, e in host],
        [DeviceRange(name, step, phase, float(s), float(e)) for name, step, phase, s, e in device],
        summary,
    )


def _host_step(step: int, t: int) -> list[tuple[str, int, int, int]]:
    """One step's host phases from time t: schedule 20, prepare 60, forward 150, sample 30, wait, book."""
    return [
        ("schedule", step, t, t + 20),
        ("prepare", step, t + 30, t + 90),
        ("forward", step, t + 100, t + 250),
        ("sample", step, t + 260, t + 290),
        ("wait", step, t + 300, t + 700),
        ("book", step, t + 710, t + 760),
    ]


def _cases() -> list[tuple[StepProfile, int]]:
    """(profile, step) cases; built anew at each check, so an answer cannot change them for the next."""
    # Without async scheduling: each step's kernels run after its launch; the GPU idles while the host
    # books the step and plans the next. Step 3's attention ends after its last-listed (later) kernel.
    sync = _profile(
        _host_step(3, 0) + _host_step(4, 800) + _host_step(5, 1600),
        [
            ("gemm", None, None, 0, 40),  # launched before the profiled window: no step
            ("gemm", 3, "forward", 120, 300),
            ("attention", 3, "forward", 305, 640),
            ("norm", 3, "forward", 310, 330),  # listed last (it starts last), ends long before attention
            ("gemm", 4, "forward", 930, 1400),
            ("argmax", 4, "sample", 1410, 1415),
            ("gemm", 5, "forward", 1725, 2300),
        ],
    )
    # With async scheduling: step 5 is launched while step 4 still runs, so its kernels follow with
    # no gap, or even start before step 4's sampler kernel (a second stream, say) ends.
    overlap = _profile(
        _host_step(4, 0) + _host_step(5, 300) + _host_step(6, 600) + _host_step(7, 900),
        [
            ("gemm", 4, "forward", 110, 500),
            ("argmax", 4, "sample", 500, 530),
            ("gemm", 5, "forward", 520, 900),
            ("argmax", 5, "sample", 905, 910),
            ("gemm", 6, "forward", 910, 1300),
            ("gemm", 7, "forward", 1390, 1500),
        ],
    )
    return [(sync, 4), (sync, 5), (overlap, 5), (overlap, 6), (overlap, 7)]


def _gap(profile: StepProfile, step: int) -> float:
    """The expected answer (worked out only after the student's function ran on every case)."""
    last = max(d.end for d in profile.device if d.step == step - 1)
    first = min(d.start for d in profile.device if d.step == step)
    return max(0.0, first - last)


def _mistakes(profile: StepProfile, step: int) -> list[tuple[float, str]]:
    """(value, what it shows) of the usual misreadings of this case (a negative value is told apart
    before these)."""
    mine = [d for d in profile.device if d.step == step]
    before = [d for d in profile.device if d.step == step - 1]
    after = [d for d in profile.device if d.step == step + 1]
    host_first = min(h.start for h in profile.host if h.step == step)
    host_last = max(h.end for h in profile.host if h.step == step - 1)
    found = [
        (
            max(0.0, mine[0].start - before[-1].end),
            "that takes the end of the range listed last for step - 1 (the list is in order of start); "
            "a longer range listed before it may end later: take the max of the ends",
        ),
        (
            max(0.0, host_first - host_last),
            "that reads the host lane (profile.host); the GPU's work is in profile.device",
        ),
    ]
    if after:
        gap_after = max(0.0, min(d.start for d in after) - max(d.end for d in mine))
        found.append(
            (gap_after, "that is the gap after the step, before step + 1: the gap before it ends at its first start")
        )
    return found


def _worked(profile: StepProfile, step: int) -> Callable[[], str]:
    def work() -> str:
        before = [d for d in profile.device if d.step == step - 1]
        mine = [d for d in profile.device if d.step == step]
        last = max(d.end for d in before)
        first = min(d.start for d in mine)
        return "\n".join(
            [
                f"step {step - 1}'s device ranges end at {[d.end for d in before]}: the last end is {last}",
                f"step {step}'s device ranges start at {[d.start for d in mine]}: the first start is {first}",
                f"gap = max(0, {first} - {last}) = {max(0.0, first - last)}",
            ]
        )

    return work


@exercise("16: the device's idle time before a step")
def check_idle_gap(fn: Callable[[StepProfile, int], float]) -> CheckResult:
    """Run fn(profile, step) on made-up profiles; it must return the device's idle gap before `step`."""
    rejected = package_answer(fn, PACKAGE, WHAT)
    if rejected is not None:
        return rejected
    cases = _cases()
    results, rejected = call_on_cases(fn, cases, PACKAGE, WHAT, lambda c: f"fn(profile, {c[1]})")
    if rejected is not None:
        return rejected
    for (profile, step), got in zip(_cases(), results):  # fresh copies: the answer may have changed its own
        try:  # a plain float: the answer's own == or float() takes no part in the comparison
            value = plain(got, 0.0)
        except TypeError as error:
            return not_plain(f"fn(profile, {step})", error)
        expected = _gap(profile, step)
        if value == expected:
            continue
        if value < 0:
            hint = "the device cannot idle for a negative time: when the step starts before step - 1 ends, the gap is 0"
        else:
            hint = next((text for v, text in _mistakes(profile, step) if v == value), HINT)
        return CheckResult(
            False,
            f"fn(profile, {step}) = {value!r} on a made-up profile is not {WHAT}. Hint: {hint}",
            reveal=_worked(profile, step),
        )
    return CheckResult(
        True,
        f"{WHAT}: correct on {len(cases)} made-up profiles (a long kernel listed early, overlapping steps).",
    )
