"""Shared by the checker tests: what a rejection must look like, answers that claim to equal anything, and the
notebooks' worked solutions."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from pagedkv.exercises import FAIL_MARK, PASS_MARK, REVEAL_AFTER, TODO_MARK, CheckResult, forget_tries, reveal

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"


def assert_rejected(result: CheckResult, *phrases: str) -> None:
    """`result` fails, shows the fail mark, and its message contains every phrase."""
    assert isinstance(result, CheckResult)
    assert not result, result.message
    assert repr(result).startswith(FAIL_MARK)
    for phrase in phrases:
        assert phrase in result.message, result.message


def assert_not_answered(result: CheckResult) -> None:
    """`result` is neither a pass nor a fail: the exercise is not answered yet (no try counted)."""
    assert isinstance(result, CheckResult)
    assert not result and not result.answered, result.message
    assert repr(result).startswith(TODO_MARK) and "not answered yet" in result.message


def revealed(check: Callable[[], CheckResult]) -> tuple[CheckResult, str]:
    """Run `check()` `REVEAL_AFTER` times from no tries (it must fail each time) and return its last
    result and what `reveal()` prints then: the only way to a worked answer."""
    forget_tries()
    for _ in range(REVEAL_AFTER):
        result = check()
        assert not result, result.message
    with redirect_stdout(io.StringIO()) as printed:
        reveal()
    return result, printed.getvalue()


class _SaysEqual:
    """Says it equals whatever it is compared with: such an answer fooled the checkers of notebooks 10-12."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


class EqualToAnything(_SaysEqual, int):
    """An int that says it equals anything."""

    __hash__ = int.__hash__


class StrEqualToAnything(_SaysEqual, str):
    """A str that says it equals anything."""

    __hash__ = str.__hash__


class ListEqualToAnything(_SaysEqual, list):  # type: ignore[type-arg]
    """A list that says it equals anything."""


def notebook_cells(notebook: str) -> list[dict[str, Any]]:
    """The cells of `notebooks/<notebook>`, as saved."""
    return json.loads((NOTEBOOKS / notebook).read_text())["cells"]


def worked_solutions(notebook: str) -> list[str]:
    """The code of each "Worked solution" of the notebook, in order; each sits in a (collapsed) markdown cell, so
    Run All does not execute it."""
    cells = [c for c in notebook_cells(notebook) if "Worked solution" in "".join(c["source"])]
    assert all(c["cell_type"] == "markdown" for c in cells), "a worked solution in a cell Run All executes"
    return ["".join(c["source"]).split("```python\n")[1].split("```")[0] for c in cells]


def run_solution(code: str, namespace: dict[str, Any]) -> object:
    """Run a worked solution in `namespace` (the checkers it calls, the notebook's names it uses) and return what it
    printed, which must be one thing: its checker's result."""
    printed: list[object] = []
    namespace["print"] = printed.append
    exec(code, namespace)  # noqa: S102
    assert len(printed) == 1, printed
    return printed[0]


def saved_outputs_show_no_pass(notebook: str) -> bool:
    """No saved output of the notebook's code cells shows the pass mark: a pass on screen is the student's own."""
    cells = notebook_cells(notebook)
    outputs = [o.get("text", "") for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    return not any(PASS_MARK in "".join(text) for text in outputs)


def assert_worked_solutions_pass(notebook: str, count: int, names: dict[str, Any]) -> None:
    """The notebook has `count` worked solutions, none run by Run All; each passes, run on its own with `names`
    defined; and no saved output shows the pass mark."""
    solutions = worked_solutions(notebook)
    assert len(solutions) == count, solutions
    for code in solutions:
        assert run_solution(code, dict(names))
    assert saved_outputs_show_no_pass(notebook)
