"""Checker of notebook 16's exercise (the device's idle time before a step): a right answer written here passes;
the usual misreadings (the range listed last instead of the last to end, no clamp at 0, the host lane, the gap
after the step) each fail with the rule they broke and never the value; pagedkv's own
idle_gaps, handed back or called, is refused; an answer that says it equals anything fails; `reveal()` works the
case out after three tries; the notebook's worked solution passes and Run All does not run it."""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest

from pagedkv.exercises import reveal
from pagedkv.exercises.profiling import check_idle_gap
from pagedkv.trace.profile import StepProfile, idle_gaps
from tests.exercises.checks import EqualToAnything, assert_rejected, assert_worked_solutions_pass

NOTEBOOK = "16_profiling_a_step.ipynb"


def right(profile: StepProfile, step: int) -> float:
    last = max(d.end for d in profile.device if d.step == step - 1)
    first = min(d.start for d in profile.device if d.step == step)
    return max(0.0, first - last)


def listed_last(profile: StepProfile, step: int) -> float:
    before = [d for d in profile.device if d.step == step - 1]
    first = min(d.start for d in profile.device if d.step == step)
    return max(0.0, first - before[-1].end)


def unclamped(profile: StepProfile, step: int) -> float:
    return (
        right(profile, step)
        if right(profile, step) > 0
        else (
            min(d.start for d in profile.device if d.step == step)
            - max(d.end for d in profile.device if d.step == step - 1)
        )
    )


def host_lane(profile: StepProfile, step: int) -> float:
    last = max(h.end for h in profile.host if h.step == step - 1)
    first = min(h.start for h in profile.host if h.step == step)
    return max(0.0, first - last)


def gap_after(profile: StepProfile, step: int) -> float:
    return right(profile, step + 1) if any(d.step == step + 1 for d in profile.device) else 0.0


def test_a_right_answer_passes() -> None:
    result = check_idle_gap(right)
    assert result, result.message
    assert check_idle_gap(lambda p, s: int(right(p, s))), "an int is a number of us too"
    assert check_idle_gap(lambda p, s: np.float32(right(p, s))), "and so is a numpy scalar"


@pytest.mark.parametrize(
    ("wrong", "phrase"),
    [
        (listed_last, "the range listed last"),
        (unclamped, "cannot idle for a negative time"),
        (host_lane, "reads the host lane"),
        (gap_after, "the gap after the step"),
        (lambda p, s: 0.0, "Hint: take the device ranges of step - 1"),
    ],
)
def test_typical_mistakes_fail_with_the_rule_and_no_value(
    wrong: Callable[[StepProfile, int], float], phrase: str
) -> None:
    result = check_idle_gap(wrong)
    assert_rejected(result, "on a made-up profile is not the device's idle time", phrase)
    # the expected gaps of the cases (290, 310, 0, 0, 90) never appear after the answer's own value
    told = result.message.split(" is not ")[1]
    assert not any(str(v) in told for v in (290, 310, 90)), told


def test_the_package_is_refused() -> None:
    assert_rejected(check_idle_gap(idle_gaps), "pagedkv's own")
    assert_rejected(check_idle_gap(lambda p, s: idle_gaps(p).get(s, 0.0)), "calls idle_gaps")
    on_a_thread = lambda p, s: ThreadPoolExecutor(1).submit(idle_gaps, p).result().get(s, 0.0)  # noqa: E731
    assert_rejected(check_idle_gap(on_a_thread), "calls idle_gaps")
    assert_rejected(check_idle_gap(290.0), "Pass your function itself")


def test_answers_that_are_no_number_fail_on_their_form() -> None:
    # graded as the int it holds (290 is right for the first case only): its == takes no part
    assert_rejected(check_idle_gap(lambda p, s: EqualToAnything(290)), "fn(profile, 5) = 290.0")
    assert_rejected(check_idle_gap(lambda p, s: "290"), "a float", "str")
    assert_rejected(check_idle_gap(lambda p, s: True), "a float", "bool")
    assert_rejected(check_idle_gap(lambda p, s: 1 / 0), "raised ZeroDivisionError")


def test_reveal_works_the_case_out_after_three_tries() -> None:
    for _ in range(3):
        result = check_idle_gap(listed_last)
    assert "reveal()" in result.message
    shown = io.StringIO()
    with redirect_stdout(shown):
        reveal()
    text = shown.getvalue()
    assert "the last end is 640.0" in text and "gap = max(0, 930.0 - 640.0) = 290.0" in text, text


def test_the_notebook_worked_solution_passes() -> None:
    names: dict[str, Any] = {"check_idle_gap": check_idle_gap}
    assert_worked_solutions_pass(NOTEBOOK, 1, names)
