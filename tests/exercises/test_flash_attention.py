"""Checker of notebook 07 (flash attention): a right answer written here passes; the answers that fooled the
second edition (the package's rewrite called on a thread, the checker's frame read, the expected row copied
from a wrong answer's message, a constant) fail with a message that never holds the expected row."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from pagedkv.exercises import reveal
from pagedkv.exercises.flash_attention import NOTEBOOK_CASE, check_kernel_block_rows
from pagedkv.worker.attn_utils import to_kernel_block_table
from tests.exercises.checks import EqualToAnything, ListEqualToAnything, assert_rejected, assert_worked_solutions_pass

NOTEBOOK_ROW = "[15, 16, 17, 3, 4, 5, 36, 37, 38]"
"""[5, 1, 12] in blocks of 48 read as pages of 16, worked out by hand: k = 3, b -> 3b, 3b+1, 3b+2."""


def right(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
    k = block_size // kernel_block_size
    return [b * k + i for b in row for i in range(k)]


def by_package(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
    return to_kernel_block_table(torch.tensor([row]), block_size // kernel_block_size)[0].tolist()


def test_right_answer_passes() -> None:
    assert check_kernel_block_rows(right)
    assert check_kernel_block_rows(lambda row, b, kb: [np.int64(x) for x in right(row, b, kb)])  # numpy ints count
    assert str(right(*NOTEBOOK_CASE)) == NOTEBOOK_ROW


def test_wrong_rows_name_the_rule_not_the_row() -> None:
    counting_up = check_kernel_block_rows(lambda row, b, kb: [x + i for x in row for i in range(b // kb)])
    assert_rejected(counting_up, "fn([5, 1, 12], 48, 16)", "counts up from the manager block id 5")
    kept = check_kernel_block_rows(lambda row, b, kb: [x for x in row for _ in range(b // kb)])
    assert_rejected(kept, "keeps the manager block id")
    short = check_kernel_block_rows(lambda row, b, kb: [x * (b // kb) for x in row])
    assert_rejected(short, "returned 3 ids for 3 manager block(s)")
    for result in (counting_up, kept, short):
        assert NOTEBOOK_ROW not in result.message and "36" not in result.message


def test_the_notebook_row_as_a_constant_fails() -> None:
    # Copied from the first edition's message, or worked out once: random rows show it is no rule.
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: [15, 16, 17, 3, 4, 5, 36, 37, 38]), "fn(")


def test_the_package_rewrite_fails_however_it_is_called() -> None:
    assert_rejected(check_kernel_block_rows(to_kernel_block_table), "pagedkv's own to_kernel_block_table")
    assert_rejected(check_kernel_block_rows(by_package), "calls to_kernel_block_table")

    def on_a_thread(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(by_package, row, block_size, kernel_block_size).result()

    assert_rejected(check_kernel_block_rows(on_a_thread), "calls to_kernel_block_table")


def test_answers_that_equal_anything_fail() -> None:
    assert_rejected(
        check_kernel_block_rows(lambda row, b, kb: [EqualToAnything(0)] * (len(row) * (b // kb))), "entry 0"
    )
    assert_rejected(
        check_kernel_block_rows(lambda row, b, kb: ListEqualToAnything([0] * (len(row) * (b // kb)))), "entry 0"
    )


def test_reading_the_checkers_frames_fails() -> None:
    def peek(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
        caller = sys._getframe(1).f_locals
        return list(caller.get("expected", right(row, block_size, kernel_block_size)))

    assert_rejected(check_kernel_block_rows(peek), "reading the checker's frames")


def test_form_of_the_answer() -> None:
    assert_rejected(check_kernel_block_rows([15, 16, 17]), "function itself")
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: str(row)), "return a list of ints")
    # a tensor of the right ids is fine too
    assert check_kernel_block_rows(
        lambda row, b, kb: torch.tensor([x * (b // kb) + i for x in row for i in range(b // kb)])
    )
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: 1 / 0), "raised ZeroDivisionError")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    def counting_up(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
        return [b + i for b in row for i in range(block_size // kernel_block_size)]

    first = check_kernel_block_rows(counting_up)
    assert "reveal()" not in first.message
    reveal()
    assert "1 wrong try so far" in capsys.readouterr().out
    check_kernel_block_rows(counting_up)
    third = check_kernel_block_rows(counting_up)
    assert "Try 3" in third.message and "reveal()" in third.message and NOTEBOOK_ROW not in third.message
    reveal()
    worked = capsys.readouterr().out
    assert "k = 48 // 16 = 3" in worked and "12 -> 36, 37, 38" in worked and NOTEBOOK_ROW in worked
    assert check_kernel_block_rows(right)  # a pass resets the count
    reveal()
    assert "0 wrong tries so far" in capsys.readouterr().out


def test_the_notebooks_worked_solution_passes_and_is_not_run() -> None:
    # Run All does not execute it: a pass on display is the student's own.
    assert_worked_solutions_pass("07_flash_attention.ipynb", 1, {"check_kernel_block_rows": check_kernel_block_rows})
