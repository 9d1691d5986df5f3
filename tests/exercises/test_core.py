"""The exercise framework itself (pagedkv.exercises): the provenance guard on every thread, frame
readers turned away, package functions restored after a check, and reveal() after three tries."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.exercises import CheckResult, Either, call_answer, exercise, plain, reveal, watch_calls
from pagedkv.models.layers import head_layout
from tests.exercises.checks import assert_rejected


def layout(a: int, b: int, c: int) -> tuple[int, int, int]:
    """What a student should write: the answer worked out by hand (32 query, 8 KV heads, 2 ranks)."""
    return (a // c, b // c, 1)


def test_own_code_passes_and_the_package_on_this_thread_does_not() -> None:
    assert call_answer(layout, (32, 8, 2), [head_layout], "the layout", "f()") == ((16, 4, 1), None)
    got, rejected = call_answer(lambda *a: head_layout(*a), (32, 8, 2), [head_layout], "the layout", "f()")
    assert_rejected(rejected, "head_layout", "write the layout yourself")


def test_a_thread_pool_started_before_the_check_is_watched_too() -> None:
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its thread runs before the check begins

    def through_pool(*args: int) -> object:
        try:
            return pool.submit(head_layout, *args).result()
        except Exception:  # a student swallowing the tripwire's exception is still caught
            return layout(*args)

    _, rejected = call_answer(through_pool, (32, 8, 2), [head_layout], "the layout", "f()")
    assert_rejected(rejected, "head_layout")
    # and a pool started inside the answer
    _, rejected = call_answer(
        lambda *a: ThreadPoolExecutor().submit(head_layout, *a).result(), (32, 8, 2), [head_layout], "the layout", "f()"
    )
    assert_rejected(rejected, "head_layout")
    pool.shutdown()


def test_the_package_function_is_itself_again_after_the_check_even_after_an_interrupt() -> None:
    code, kwdefaults = head_layout.__code__, head_layout.__kwdefaults__

    def interrupted(*args: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_answer(interrupted, (32, 8, 2), [head_layout], "the layout", "f()")
    assert head_layout.__code__ is code and head_layout.__kwdefaults__ == kwdefaults
    assert head_layout(32, 8, 2).num_heads == 16


def test_reading_the_checkers_frames_is_turned_away() -> None:
    def peek(*args: int) -> object:
        return sys._getframe(1).f_locals.get("expected")

    _, rejected = call_answer(peek, (32, 8, 2), [head_layout], "the layout", "f()")
    assert_rejected(rejected, "reading the checker's frames")


def test_a_function_with_a_closure_is_watched_by_the_profiler() -> None:
    seen = []

    def with_closure(x: int) -> int:
        seen.append(x)  # `seen` makes this a closure: no tripwire, the profiler still notices it
        return x

    with watch_calls([with_closure]) as called:
        with_closure(1)
    assert called == ["test_a_function_with_a_closure_is_watched_by_the_profiler.<locals>.with_closure"]
    assert seen == [1]


def test_reveal_only_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    @exercise("test: the answer is 4")
    def check(answer: int) -> CheckResult:
        if answer == 4:
            return CheckResult(True, "correct.")
        return CheckResult(False, "not the sum of two and two.", reveal=lambda: "2 + 2 = 4")

    for tries in (1, 2):
        assert "reveal()" not in check(tries).message
        reveal()
        assert "2 + 2 = 4" not in capsys.readouterr().out
    assert "reveal()" in check(3).message
    reveal()
    assert "2 + 2 = 4" in capsys.readouterr().out
    assert check(4)


@pytest.mark.parametrize("notebook", sorted((Path(__file__).parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_a_notebook_whose_checkers_offer_reveal_imports_it(notebook: Path) -> None:
    """After three wrong tries a checker says "Stuck? `reveal()` works out this case for you": the
    notebook must have imported `reveal` by its first exercise cell, or the advice is a NameError."""
    cells = [c["source"] for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c) if isinstance(c, list) else c for c in cells]
    first_check = next(
        (i for i, s in enumerate(sources) if re.search(r"from pagedkv\.exercises\.\w+ import .*check_", s)), None
    )
    if first_check is None:
        pytest.skip(f"{notebook.name} has no exercise")
    imports = [i for i, s in enumerate(sources) if re.search(r"from pagedkv\.exercises import .*\breveal\b", s)]
    assert imports and imports[0] <= first_check, f"{notebook.name}: import reveal in the cell of its first exercise"


def test_plain_rebuilds_answers_from_builtin_types_and_turns_away_other_forms() -> None:
    class Shifty(list):  # type: ignore[type-arg]
        """A list whose own methods tell another story than its entries."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([7, 7])

        def __len__(self) -> int:
            return 2

    got = plain(Shifty([1, 2, 3]), [0])
    assert got == [1, 2, 3] and type(got) is list  # read through list's own methods
    assert plain(range(2, 5), [0]) == [2, 3, 4] and plain(torch.tensor([1, 2]), [0]) == [1, 2]
    assert plain(np.int64(4), 0) == 4 and type(plain(np.int64(4), 0)) is int
    assert plain(torch.tensor(5), 0) == 5 and plain((1, [2]), (0, [0])) == (1, [2])
    assert plain(None, Either(((0, 0, 0), None))) is None and plain([1, 2, 3], Either(((0, 0, 0), None))) == (1, 2, 3)
    assert plain({"a": 1}, {"": 0}) == {"a": 1}
    for value, like, words in [
        (True, 0, "an int, not a bool"),
        (2.0, 0, "an int, not a float"),
        ("3", 0, "an int, not a str"),
        ([1, "2"], [0], "an int, not a str"),
        ((1, 2), (0, 0, 0), "3 values, not 2"),
        (torch.tensor([[1]]), [0], "a list of ints, not a Tensor"),
        (object(), Either(((0, 0, 0), None)), "a tuple (int, int, int) or None, not an object"),
    ]:
        with pytest.raises(TypeError, match=re.escape(words)):
            plain(value, like)


def test_a_closure_run_on_an_earlier_thread_is_seen_and_no_profiler_stays_behind() -> None:
    """No tripwire fits a function with a closure; the profiler set on threads started before
    the check (Python 3.11 through ctypes, 3.12+ by threading) sees it, and is gone afterwards."""
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its thread runs before the check begins
    seen = []

    def with_closure(x: int) -> int:
        seen.append(x)
        return x

    with watch_calls([with_closure]) as called:
        assert pool.submit(with_closure, 1).result() == 1
    assert called == [with_closure.__qualname__]
    assert pool.submit(sys.getprofile).result() is None
    pool.shutdown()
