"""Checker for notebook 07 (flash attention): rewrite a block table row into kernel blocks.

    check_kernel_block_rows(fn)   fn(row, block_size, kernel_block_size) -> the kernel's row

The student's function runs first, on the notebook's case and on rows and block sizes drawn
afresh on each call, some of them geometries no backend of the package reads (kernel pages of 3
or 5 tokens), so an engine cannot be asked for the answer. Only then does the checker work out
each expected row. A function that hands the work to the attention group's own rewrite
(`to_kernel_block_table`, directly, through a wrapper or on another thread) is turned away.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.worker.attn_utils import to_kernel_block_table

RowFn = Callable[[list[int], int, int], Any]
Case = tuple[list[int], int, int]

NOTEBOOK_CASE: Case = ([5, 1, 12], 48, 16)
PACKAGE = (to_kernel_block_table,)
WHAT = "the rewrite"


def _cases(num_hidden: int, rng: random.Random) -> list[Case]:
    """The notebook's case, then random (row, block_size, kernel_block_size) with a whole split:
    page sizes the backends read (16, 32, 64) and sizes none reads (1, 3, 5), rows that repeat
    no block and may hold the null block 0."""
    cases = [NOTEBOOK_CASE]
    for i in range(num_hidden):
        kernel_block_size = rng.choice([16, 32, 64] if i % 2 else [1, 3, 5])
        block_size = kernel_block_size * rng.choice([1, 2, 3, 4, 5, 8])
        cases.append((rng.sample(range(100), rng.randint(1, 6)), block_size, kernel_block_size))
    return cases


@exercise("07: a block table row in kernel blocks")
def check_kernel_block_rows(fn: RowFn, num_hidden: int = 12) -> CheckResult:
    """Run `fn(row, block_size, kernel_block_size)` on the notebook's case and random ones, then
    check every row against the rule: manager block b is kernel blocks b*k ... b*k + k - 1."""
    own = package_answer(fn, PACKAGE, WHAT)
    if own is not None:
        return own
    cases = _cases(num_hidden, random.Random())
    results, rejected = call_on_cases(
        fn,
        [(list(row), bs, kbs) for row, bs, kbs in cases],
        PACKAGE,
        WHAT,
        lambda case: f"fn({case[0]}, {case[1]}, {case[2]})",
    )
    if rejected is not None:
        return rejected
    for (row, block_size, kernel_block_size), got in zip(cases, results, strict=True):
        wrong = _wrong_row(row, block_size, kernel_block_size, got)
        if wrong is not None:
            return wrong
    return CheckResult(
        True,
        f"Your rewrite is right on the notebook's row and {num_hidden} random rows and "
        "block sizes (some of them page sizes no backend reads).",
    )


def _wrong_row(row: list[int], block_size: int, kernel_block_size: int, got: Any) -> CheckResult | None:
    """None if `got` is the kernel row of `row`, else which rule it breaks (never the right row)."""
    call = f"fn({row}, {block_size}, {kernel_block_size})"
    k = block_size // kernel_block_size

    def worked() -> str:
        lines = [
            f"k = {block_size} // {kernel_block_size} = {k} kernel blocks per manager block; "
            f"manager block b holds tokens b*{block_size} ..., which are kernel blocks b*{k} ... b*{k} + {k - 1}:"
        ]
        lines += [f"  {b} -> {', '.join(str(b * k + i) for i in range(k))}" for b in row]
        lines.append(f"{call} = {[b * k + i for b in row for i in range(k)]}")
        return "\n".join(lines)

    try:  # plain ints (numpy's and torch's too): an answer's own == takes no part in the comparisons
        got = plain(got, [0])
    except TypeError as error:
        return CheckResult(False, f"{call}: {error}; return a list of ints (kernel block ids).", reveal=worked)
    if len(got) != len(row) * k:
        return CheckResult(
            False,
            (
                f"{call} returned {len(got)} ids for {len(row)} manager block(s): each manager block of {block_size} "
                f"tokens is {block_size} // {kernel_block_size} kernel blocks, one id each, in the row's order."
            ),
            reveal=worked,
        )
    expected = [b * k + i for b in row for i in range(k)]
    if got == expected:
        return None
    j = next(j for j, (a, e) in enumerate(zip(got, expected)) if a != e)
    b, i = row[j // k], j % k
    if got == [b + i for b in row for i in range(k)]:
        why = (
            f"it counts up from the manager block id {b}, but {b} numbers blocks of {block_size} tokens; "
            f"in pages of {kernel_block_size} tokens, how many kernel blocks come before manager block {b}?"
        )
    elif got == [b for b in row for _ in range(k)]:
        why = f"it keeps the manager block id {b}; the kernel numbers pages of {kernel_block_size} tokens."
    else:
        why = (
            f"manager block {b} starts at token {b} * {block_size} of the cache; which page of "
            f"{kernel_block_size} tokens holds its token {i * kernel_block_size}?"
        )
    return CheckResult(
        False, f"{call}: entry {j} (kernel block {i} of manager block {b}) is {got[j]}: {why}", reveal=worked
    )
