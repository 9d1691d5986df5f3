"""Notebook 08's checkers accept the right mode and tell a wrong one which rule it missed.

The right answers are worked out by hand from the rules (issue 9 point 1), independently
of the resolver the checkers call. A wrong answer's message never names the resolved mode
(the second edition's "the resolver says X" let a student copy it, issue 32); `reveal()` does,
after three wrong tries of that exercise.
"""

from __future__ import annotations

import itertools
import logging
import re

import pytest

import pagedkv.exercises.cudagraph as cudagraph
from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.compilation.resolve import resolve_explained
from pagedkv.config import CUDAGraphMode
from pagedkv.exercises import reveal
from pagedkv.exercises.cudagraph import LOWERING_EXERCISES, check_lowering, check_raising
from tests.exercises.checks import (
    StrEqualToAnything,
    assert_not_answered,
    assert_rejected,
    assert_worked_solutions_pass,
    revealed,
)

M, S = CUDAGraphMode, AttentionCGSupport

RIGHT = {1: M.NONE, 2: M.FULL_DECODE_ONLY, 3: M.PIECEWISE, 4: M.PIECEWISE, 5: M.FULL_DECODE_ONLY}
"""Exercise -> its answer, worked out by hand from the rules of notebook 08's section 4."""

# (exercise, a tempting wrong answer, the rule and hint its message must name)
WRONG = [
    (1, ValueError, "rule 1 comes before every rule that raises"),
    (1, M.PIECEWISE, "breaks rule 1"),
    (
        2,
        M.FULL,
        "you kept FULL, but rule 2 applies: the backend (support UNIFORM_BATCH) cannot capture a mixed "
        "batch in one graph (only ALWAYS can), so FULL cannot stay FULL",
    ),
    (2, M.FULL_AND_PIECEWISE, "breaks rule 5"),
    (2, M.NONE, "Your answer runs decode batches eagerly"),
    (3, M.NONE, "rule 3 applies"),
    (3, ValueError, "lowered by rule 3 before the last guard (rule 6)"),
    (3, M.FULL_DECODE_ONLY, "breaks rule 3"),
    (4, M.FULL_DECODE_ONLY, "you kept FULL_DECODE_ONLY, but rule 4 applies"),
    (4, M.FULL_AND_PIECEWISE, "breaks rule 4"),
    (5, M.FULL, "the rules only take full graphs away, they never add one"),
    (5, M.PIECEWISE, "breaks rule 5"),
]


def names(text: str, mode: CUDAGraphMode) -> bool:
    """`text` names `mode` as a word of its own (FULL_AND_PIECEWISE does not name PIECEWISE)."""
    return re.search(rf"(?<![A-Z_]){mode.name}(?![A-Z_])", text) is not None


def test_there_is_one_exercise_per_lowering_rule() -> None:
    assert sorted(e.rule for e in LOWERING_EXERCISES.values()) == [1, 2, 3, 4, 5]
    assert set(RIGHT) == set(LOWERING_EXERCISES)


@pytest.mark.parametrize("number", sorted(RIGHT))
def test_each_exercise_triggers_only_its_rule(number: int) -> None:
    result = LOWERING_EXERCISES[number].resolve()
    assert result.error is None and len(result.warnings) == 1  # one rule fired, one change


@pytest.mark.parametrize("number", sorted(RIGHT))
def test_right_answer_in_any_spelling(number: int) -> None:
    right = RIGHT[number]
    for answer in (right, right.name, right.name.lower(), f" {right.name} "):
        result = check_lowering(number, answer)
        assert result.ok, result.message
        assert f"resolves to {right.name}" in result.message and "log: CUDAGraphMode." in result.message


@pytest.mark.parametrize(("number", "wrong", "phrase"), WRONG)
def test_wrong_answer_names_the_rule_it_missed(number: int, wrong: object, phrase: str) -> None:
    assert_rejected(check_lowering(number, wrong), f"Exercise {number}: ", phrase)


@pytest.mark.parametrize("number", sorted(RIGHT))
def test_no_wrong_answer_is_told_the_resolved_mode(number: int) -> None:
    # The second edition ended every wrong answer with "The resolver: X resolves to Y": copy Y, pass.
    for wrong in [*(m for m in M if m is not RIGHT[number]), ValueError, "raises"]:
        result, work = revealed(lambda w=wrong: check_lowering(number, w))
        assert_rejected(result, "rule")
        assert not names(result.message, RIGHT[number]), result.message
        assert "resolves to" not in result.message and "log:" not in result.message
        assert "worked out" in work


def test_an_answer_that_equals_anything_fails() -> None:
    assert_rejected(check_lowering(2, StrEqualToAnything("NONE")), "Exercise 2: NONE breaks no rule")
    pair = (StrEqualToAnything("NONE"), StrEqualToAnything("ALWAYS"))
    assert_rejected(check_raising({pair}), "('NONE', 'ALWAYS') does not raise")


def test_each_exercise_counts_its_own_tries_and_reveal_works_it_out(capsys: pytest.CaptureFixture[str]) -> None:
    check_lowering(1, "FULL")
    check_lowering(1, "FULL")
    assert "reveal()" not in check_lowering(2, "FULL").message  # two tries of exercise 1 do not count for 2
    reveal()
    assert "1 wrong try so far" in capsys.readouterr().out
    check_lowering(2, "NONE")
    third = check_lowering(2, ValueError)
    assert "Try 3" in third.message and "reveal()" in third.message
    reveal()
    worked = capsys.readouterr().out
    assert "rule 2: FULL -> FULL_DECODE_ONLY (full graphs of mixed batches need support ALWAYS" in worked
    assert "= FULL_DECODE_ONLY (decode FULL, mixed NONE)" in worked
    assert check_lowering(2, "FULL_DECODE_ONLY")


def test_unreadable_answers() -> None:
    assert_not_answered(check_lowering(1, ...))
    assert "is neither a mode" in check_lowering(1, "SOMETIMES").message
    assert "no lowering exercise 9" in check_lowering(9, "NONE").message


def test_resolve_explained_keeps_warnings_without_printing(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("pagedkv")
    handlers = list(logger.handlers)
    caplog.set_level(logging.WARNING)  # a handler on the root logger, as logging.basicConfig would add
    result = resolve_explained(
        "full",
        S.UNIFORM_SINGLE_TOKEN_DECODE,
        backend_name="B",
        attention_compiled_piecewise=True,
        uniform_decode_query_len=2,
    )
    assert caplog.records == [] and logger.propagate
    assert result.resolved is M.PIECEWISE  # rule 2 (-> FULL_AND_PIECEWISE), then rule 4 (-> PIECEWISE)
    assert [(step.rule, step.before, step.after) for step in result.steps] == [
        (2, M.FULL, M.FULL_AND_PIECEWISE),
        (4, M.FULL_AND_PIECEWISE, M.PIECEWISE),
    ]
    assert result.warnings == tuple(step.message for step in result.steps)
    assert logger.handlers == handlers and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="uniform_decode_query_len must be >= 1"):  # bad input still raises
        resolve_explained(
            M.FULL, S.ALWAYS, backend_name="B", attention_compiled_piecewise=True, uniform_decode_query_len=0
        )


def test_only_full_with_never_raises() -> None:
    # ... whatever the compile setting and decode length, and only without enforce_eager.
    for mode, support in itertools.product(M, S):
        for pw, q, eager in itertools.product((True, False), (1, 2), (True, False)):
            error = resolve_explained(
                mode,
                support,
                backend_name="B",
                attention_compiled_piecewise=pw,
                uniform_decode_query_len=q,
                enforce_eager=eager,
            ).error
            assert (error is not None) == (mode is M.FULL and support is S.NEVER and not eager)


def test_the_raising_set_is_no_importable_helper() -> None:
    # The second edition shipped the answer of exercise 6 as `raising_configurations()`.
    assert not hasattr(cudagraph, "raising_configurations")
    assert not any(callable(v) and "raising" in name and name != "check_raising" for name, v in vars(cudagraph).items())


def test_check_raising(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_raising({("FULL", "NEVER")})
    assert check_raising([(M.FULL, S.NEVER)])
    assert check_raising({("full", "never")})  # any case, as check_lowering reads mode names
    extra = check_raising({("FULL", "NEVER"), ("FULL_DECODE_ONLY", "NEVER")})
    assert_rejected(extra, "('FULL_DECODE_ONLY', 'NEVER') does not raise", "lowered by rule 3")
    assert_rejected(check_raising({("FULL", "NEVER"), ("PIECEWISE", "NEVER")}), "no full graph at all")
    assert_rejected(check_raising({("FULL", "UNIFORM_BATCH")}), "only support NEVER can make the resolver raise")
    missing = check_raising(set())
    assert_rejected(missing, "misses pairs that raise", "rule 2")
    assert not names(missing.message, M.FULL) and "NEVER" not in missing.message  # was "('FULL', 'NEVER') raises too"
    assert "Try 4" in missing.message
    reveal()
    worked = capsys.readouterr().out
    assert "FULL: raises (rule 2" in worked and "The set: [('FULL', 'NEVER')]" in worked
    assert "could not read" in check_raising({("FULL", "SOMETIMES")}).message
    assert_not_answered(check_raising(...))


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    checkers = {"check_lowering": check_lowering, "check_raising": check_raising}
    assert_worked_solutions_pass("08_cuda_graphs_and_torch_compile.ipynb", 6, checkers)
