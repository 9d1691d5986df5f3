"""Checker for notebook 07 (flash attention): rewrite a block table row into kernel blocks.

    check_kernel_block_rows(fn)   fn(row, block_size, kernel_block_size) -> the kernel's row

The expected rows come from the attention group's own rewrite (`to_kernel_block_table`), on the
notebook's case and on random rows and block sizes drawn afresh on each call. A function that
hands the work to `to_kernel_block_table` is turned away.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedkv.exercises import CheckResult, call_answer, package_answer
from pagedkv.worker.attn_utils import to_kernel_block_table

RowFn = Callable[[list[int], int, int], Any]

NOTEBOOK_CASE = ([5, 1, 12], 48, 16)


def _cases(num_hidden: int, rng: random.Random) -> Iterator[tuple[list[int], int, int]]:
    """The notebook's case, then random (row, block_size, kernel_block_size) with a whole split."""
    yield NOTEBOOK_CASE
    for _ in range(num_hidden):
        kernel_block_size = rng.choice([16, 32, 64])
        block_size = kernel_block_size * rng.choice([1, 2, 3, 4, 5, 8])
        yield rng.sample(range(60), rng.randint(1, 6)), block_size, kernel_block_size


def check_kernel_block_rows(fn: RowFn, num_hidden: int = 12) -> CheckResult:
    """Compare `fn(row, block_size, kernel_block_size)` with the attention group's rewrite."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    own = package_answer(fn, [to_kernel_block_table], "the rewrite")
    if own is not None:
        return own
    for row, block_size, kernel_block_size in _cases(num_hidden, random.Random()):
        k = block_size // kernel_block_size
        expected = to_kernel_block_table(torch.tensor([row]), k)[0].tolist()
        call = f"fn({row}, {block_size}, {kernel_block_size})"
        got, rejected = call_answer(fn, (list(row), block_size, kernel_block_size), [to_kernel_block_table],
                                    "the rewrite", call)
        if rejected is not None:
            return rejected
        got_list = list(got) if isinstance(got, (list, tuple)) else got
        if got_list != expected:
            return CheckResult(False, (
                f"{call} returned {got!r}, expected {expected}: each manager block b becomes the "
                f"{k} kernel blocks b*{k} ... b*{k}+{k - 1} (k = {block_size} // {kernel_block_size}), in order."
            ))
    return CheckResult(True, f"Your rewrite matches the attention group's on the notebook's row and "
                             f"{num_hidden} random rows and block sizes.")
