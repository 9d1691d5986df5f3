"""Notebook 13's checkers: right answers written here from the rules (not from the package) pass; wrong ones (the
mistakes a student makes, the package's own functions, the notebook's cases copied as constants, a value that says it
equals anything) fail with a message that holds no expected value."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from pagedkv.config import CUDAGraphMode
from pagedkv.engine.rejection_sampler import RejectionSampler
from pagedkv.exercises import reveal
from pagedkv.exercises.spec_decode import (
    SHOWN_EMIT_CASES,
    SHOWN_SLOT_CASES,
    SPEC_MODE_CASES,
    check_emitted,
    check_rollback_slots,
    check_spec_modes,
)
from pagedkv.worker.input_batch import compute_slot_mapping
from tests.exercises.checks import ListEqualToAnything, assert_rejected, assert_worked_solutions_pass

RIGHT_MODES = {"a": "FULL_DECODE_ONLY", "b": "NONE", "c": "PIECEWISE", "d": "PIECEWISE"}
"""Worked out by hand from pagedkv/compilation/resolve.py: TRITON_ATTN (ALWAYS) keeps its FULL decode graphs of 3
tokens; TRITON_MLA (UNIFORM_SINGLE_TOKEN_DECODE) loses them by the rule for decodes longer than one token (rule 4),
to NONE or PIECEWISE by the compile setting; TORCH_REF (NEVER) by rule 3."""


def right_emitted(drafts: list[int], target: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def right_slots(block_ids: list[int], block_size: int, computed: int, drafts: list[int], accepted: int) -> list[int]:
    positions = range(computed + 1 + accepted, computed + 1 + len(drafts))
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def test_emitted() -> None:
    result = check_emitted(right_emitted)
    assert result, result.message
    assert [right_emitted(*case) for case in SHOWN_EMIT_CASES] == [[10, 11, 12, 13], [10, 20], [9], [42]]


@pytest.mark.parametrize(
    ("wrong", "phrase"),
    [
        (lambda d, t: right_emitted(d, t)[:-1], "the bonus token"),
        (lambda d, t: [x for x, y in zip(d, t) if x == y] + [t[-1]], "acceptance stops at the first draft"),
        (lambda d, t: d[: len(right_emitted(d, t))] if d != t[:-1] else t, "a rejected draft is not emitted"),
        (lambda d, t: t[:1], "emit the longest prefix"),
    ],
)
def test_emitted_rejects_wrong_answers(wrong: Any, phrase: str) -> None:
    result = check_emitted(wrong)
    assert_rejected(result, "is not what the step emits", phrase)
    assert "[10, 11, 12, 13]" not in result.message.split("is not what")[1]


def test_emitted_rejects_the_package_and_odd_answers() -> None:
    def by_the_sampler(drafts: list[int], target: list[int]) -> list[int]:
        from pagedkv.exercises.spec_decode import _emitted_by_the_engine

        return _emitted_by_the_engine(drafts, target)

    assert_rejected(check_emitted(by_the_sampler), "calls RejectionSampler.__call__")
    on_a_thread = lambda d, t: ThreadPoolExecutor(1).submit(by_the_sampler, d, t).result()  # noqa: E731
    assert_rejected(check_emitted(on_a_thread), "calls RejectionSampler.__call__")
    assert_rejected(check_emitted(RejectionSampler.__call__), "pagedkv's own RejectionSampler.__call__")
    assert_rejected(
        check_emitted(lambda d, t: ListEqualToAnything()), "is not what the step emits"
    )  # graded as the [] it holds
    assert check_emitted(lambda d, t: tuple(right_emitted(d, t)))  # a tuple of the right ids is fine too
    assert_rejected(check_emitted(lambda d, t: str(right_emitted(d, t))), "a list of token ids")
    assert_rejected(check_emitted(lambda d, t: [][0]), "raised IndexError")
    assert not check_emitted([1, 2])
    copied = {repr(case): right_emitted(*case) for case in SHOWN_EMIT_CASES}
    assert_rejected(check_emitted(lambda d, t: copied.get(repr((d, t)), [0])), "is not what the step emits")


def test_spec_modes() -> None:
    result = check_spec_modes(RIGHT_MODES)
    assert result, result.message
    assert check_spec_modes({k: CUDAGraphMode[v] for k, v in RIGHT_MODES.items()})


def test_spec_modes_rejects_wrong_answers() -> None:
    result = check_spec_modes({**RIGHT_MODES, "b": "FULL_DECODE_ONLY"})  # forgot the decode query length
    assert_rejected(result, "case b (TRITON_MLA, FULL_DECODE_ONLY)", "rule 4 applies", "3 query tokens")
    result = check_spec_modes({**RIGHT_MODES, "c": "NONE"})  # lowered, but compile=True keeps piecewise graphs
    assert_rejected(result, "case c", "compiled piecewise")
    assert_rejected(check_spec_modes({**RIGHT_MODES, "a": "NONE"}), "case a", "no rule applies")
    assert_rejected(check_spec_modes({"a": "FULL"}), "one mode per case")
    assert_rejected(check_spec_modes({**RIGHT_MODES, "d": "fast"}), "case d", "neither a mode")


def test_rollback_slots() -> None:
    result = check_rollback_slots(right_slots)
    assert result, result.message
    assert [right_slots(*case) for case in SHOWN_SLOT_CASES] == [[36, 37], [46, 47, 16, 17], [], [16, 17]]


@pytest.mark.parametrize(
    ("wrong", "phrase"),
    [
        (lambda b, bs, c, d, a: list(range(c + 1 + a, c + 1 + len(d))), "those are positions"),
        (lambda b, bs, c, d, a: right_slots(b, bs, c - 1, d, a), "holds the request's last known token"),
        (lambda b, bs, c, d, a: right_slots(b, bs, c, d, 0), "only rejected drafts roll back"),
        (lambda b, bs, c, d, a: right_slots(b, bs, c, d, 0)[: len(d) - a], "the rejected ones are the last"),
        (lambda b, bs, c, d, a: right_slots(b, bs, c, d, a)[::-1], "in position order"),
    ],
)
def test_rollback_slots_rejects_wrong_answers(wrong: Any, phrase: str) -> None:
    result = check_rollback_slots(wrong)
    assert_rejected(result, "are not the slots rolled back", phrase)
    assert "[36, 37]" not in result.message.split("are not the slots")[1]


def test_rollback_slots_rejects_the_package() -> None:
    def by_the_runner(b: list[int], bs: int, c: int, d: list[int], a: int) -> list[int]:
        pos = torch.arange(c + 1 + a, c + 1 + len(d))
        return compute_slot_mapping(torch.tensor([b]), torch.zeros_like(pos), pos, bs).tolist()

    assert_rejected(check_rollback_slots(by_the_runner), "calls compute_slot_mapping")
    assert_rejected(check_rollback_slots(compute_slot_mapping), "pagedkv's own compute_slot_mapping")
    assert_rejected(check_rollback_slots(lambda *a: ListEqualToAnything()), "are not the slots rolled back")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        result = check_rollback_slots(lambda b, bs, c, d, a: list(range(c + 1 + a, c + 1 + len(d))))
    assert "Try 3" in result.message
    reveal()
    worked = capsys.readouterr().out
    assert "positions [8, 9] are rejected" in worked and "position 8: block_ids[2] = 9, offset 0 -> slot 36" in worked
    assert worked.rstrip().endswith("= [36, 37]")
    for _ in range(3):
        check_emitted(lambda d, t: d)
    reveal()
    worked = capsys.readouterr().out
    assert "all accepted: the bonus is the target's token after the last draft, 13" in worked
    for _ in range(3):
        check_spec_modes({**RIGHT_MODES, "b": "PIECEWISE"})
    reveal()
    assert "rule 4: FULL_DECODE_ONLY -> NONE" in capsys.readouterr().out
    assert set(SPEC_MODE_CASES) == set(RIGHT_MODES)


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its checker;
    no saved output of the notebook shows a pass mark, so a pass on screen is the student's own."""
    checkers = {
        "check_emitted": check_emitted,
        "check_spec_modes": check_spec_modes,
        "check_rollback_slots": check_rollback_slots,
    }
    assert_worked_solutions_pass("13_speculative_decoding.ipynb", 3, checkers)
