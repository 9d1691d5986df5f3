"""Notebook 08's checkers accept the right mode and explain a wrong one.

The right answers are worked out by hand from the rules (issue 9 point 1), independently
of the resolver the checkers call.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.compilation import CUDAGraphMode
from pagedkv.exercises.cudagraph import (
    LOWERING_EXERCISES,
    RULES,
    check_lowering,
    check_raising,
    raising_configurations,
    resolve_explained,
)

M, S = CUDAGraphMode, AttentionCGSupport

# exercise -> (right answer, a tempting wrong one, a phrase the explanation of that wrong one must contain)
ANSWERS = {
    1: (M.NONE, ValueError, "you said it raises, but it resolves to NONE"),
    2: (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE, "the model is not compiled piecewise"),
    3: (M.PIECEWISE, M.NONE, "the resolver says PIECEWISE (decode PIECEWISE, mixed PIECEWISE)"),
    4: (M.PIECEWISE, M.FULL_DECODE_ONLY, "you kept the configured mode FULL_DECODE_ONLY"),
    5: (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE, "the model is not compiled piecewise"),
}


def test_there_is_one_exercise_per_lowering_rule() -> None:
    assert sorted(e.rule for e in LOWERING_EXERCISES.values()) == [1, 2, 3, 4, 5]
    assert set(ANSWERS) == set(LOWERING_EXERCISES)


@pytest.mark.parametrize("number", sorted(ANSWERS))
def test_each_exercise_triggers_only_its_rule(number: int) -> None:
    result = LOWERING_EXERCISES[number].resolve()
    assert result.error is None and len(result.warnings) == 1  # one rule fired, one change


@pytest.mark.parametrize("number", sorted(ANSWERS))
def test_right_answer_in_any_spelling(number: int) -> None:
    right = ANSWERS[number][0]
    for answer in (right, right.name, right.name.lower(), f" {right.name} "):
        result = check_lowering(number, answer)
        assert result.ok, result.message
        assert f"resolves to {right.name}" in result.message and "log: cudagraph_mode" in result.message


@pytest.mark.parametrize("number", sorted(ANSWERS))
def test_wrong_answer_is_explained(number: int) -> None:
    right, wrong, phrase = ANSWERS[number]
    result = check_lowering(number, wrong)
    assert not result.ok
    rule = LOWERING_EXERCISES[number].rule
    assert phrase in result.message
    assert f"Rule {rule}: {RULES[rule]}" in result.message
    assert f"resolves to {right.name}" in result.message  # the resolver's own verdict and log
    assert "log: cudagraph_mode" in result.message


def test_unreadable_answers() -> None:
    assert "Replace `...`" in check_lowering(1, ...).message
    assert "is neither a mode" in check_lowering(1, "SOMETIMES").message
    assert "no lowering exercise 9" in check_lowering(9, "NONE").message


def test_resolve_explained_keeps_warnings_without_printing(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("pagedkv")
    handlers = list(logger.handlers)
    caplog.set_level(logging.WARNING)  # a handler on the root logger, as logging.basicConfig would add
    result = resolve_explained("full", S.UNIFORM_SINGLE_TOKEN_DECODE, backend_name="B",
                               attention_compiled_piecewise=True, uniform_decode_query_len=2)
    assert caplog.records == [] and logger.propagate
    assert result.resolved is M.PIECEWISE  # rule 2 (-> FULL_AND_PIECEWISE), then rule 4 (-> PIECEWISE)
    assert [w.split(" with ")[0] for w in result.warnings] == [
        "cudagraph_mode FULL -> FULL_AND_PIECEWISE", "cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE",
    ]
    assert logger.handlers == handlers and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="uniform_decode_query_len must be >= 1"):  # bad input still raises
        resolve_explained(M.FULL, S.ALWAYS, backend_name="B", attention_compiled_piecewise=True,
                          uniform_decode_query_len=0)


def test_raising_configurations_are_full_with_never() -> None:
    assert raising_configurations() == {("FULL", "NEVER")}
    # ... whatever the compile setting and decode length, and only without enforce_eager.
    for mode, support in itertools.product(M, S):
        for pw, q, eager in itertools.product((True, False), (1, 2), (True, False)):
            error = resolve_explained(mode, support, backend_name="B", attention_compiled_piecewise=pw,
                                      uniform_decode_query_len=q, enforce_eager=eager).error
            assert (error is not None) == (mode is M.FULL and support is S.NEVER and not eager)


def test_check_raising() -> None:
    assert check_raising({("FULL", "NEVER")}).ok
    assert check_raising([(M.FULL, S.NEVER)]).ok
    assert check_raising({("full", "never")}).ok  # any case, as check_lowering reads mode names (was "could not read")
    extra = check_raising({("FULL", "NEVER"), ("FULL_DECODE_ONLY", "NEVER")})
    assert not extra.ok
    assert "('FULL_DECODE_ONLY', 'NEVER') does not raise" in extra.message
    assert "FULL_DECODE_ONLY resolves to PIECEWISE" in extra.message
    missing = check_raising(set())
    assert not missing.ok and "('FULL', 'NEVER') raises too" in missing.message
    assert "please try cudagraph_mode=PIECEWISE" in missing.message
    assert "could not read" in check_raising({("FULL", "SOMETIMES")}).message
    assert "Replace `...`" in check_raising(...).message
