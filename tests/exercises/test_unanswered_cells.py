"""Run All must leave an unanswered exercise alone: no ✗, no try spent.

The workbook's pattern is `answer = ...` and a checker called only under `if answer is not ...`
(or in the `else:` of `if answer is ...:`). These tests read the notebooks' code and execute
nothing: a cell that hands a checker a name still bound to `...`, or a literal `...`, outside
such a guard is a cell that Run All grades before the student has written anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _is_ellipsis(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _guard_names(test: ast.expr) -> tuple[set[str], set[str]]:
    """Names the test of an `if` proves bound to something else than `...`, in (its body, its
    orelse): `x is not ...` (alone or joined by `and`) guards the body, `x is ...` (alone or
    joined by `or`) the orelse."""
    joined = isinstance(test, ast.BoolOp)
    comparisons = test.values if joined else [test]
    names: dict[type[ast.cmpop], set[str]] = {ast.Is: set(), ast.IsNot: set()}
    for comparison in comparisons:
        if (
            isinstance(comparison, ast.Compare)
            and isinstance(comparison.left, ast.Name)
            and len(comparison.ops) == 1
            and type(comparison.ops[0]) in names
            and _is_ellipsis(comparison.comparators[0])
        ):
            names[type(comparison.ops[0])].add(comparison.left.id)
    body = names[ast.IsNot] if not joined or isinstance(test.op, ast.And) else set()
    orelse = names[ast.Is] if not joined or isinstance(test.op, ast.Or) else set()
    return body, orelse


def _is_stub(function: ast.FunctionDef, lines: list[str]) -> bool:
    """A function left for the student to write: a `...` statement or a TODO in its body
    (its lines, and the indented comments after its last statement, which the AST leaves out)."""
    body = lines[function.lineno - 1 : function.end_lineno]
    for line in lines[function.end_lineno or function.lineno :]:
        if not line.strip().startswith("#") or len(line) - len(line.lstrip()) <= function.col_offset:
            break
        body.append(line)
    return any("TODO" in line for line in body) or any(
        isinstance(node, ast.Expr) and _is_ellipsis(node.value) for node in ast.walk(function)
    )


def unguarded_checks(source: str) -> list[str]:
    """The `check_*(...)` calls of a cell that receive `...`, a name the cell binds to `...` or a
    stub function of the cell, outside an `is ...` guard on that name, as "check_x(name)" strings."""
    tree = ast.parse(source)
    placeholders = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_ellipsis(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    } | {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and _is_stub(node, source.splitlines())
    }
    found: list[str] = []

    def visit(node: ast.AST, guarded: frozenset[str]) -> None:
        if isinstance(node, ast.If):
            body, orelse = _guard_names(node.test)
            visit(node.test, guarded)
            for child in node.body:
                visit(child, guarded | body)
            for child in node.orelse:
                visit(child, guarded | orelse)
            return
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if callee.startswith("check_"):
                for arg in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    for leaf in ast.walk(arg):
                        if _is_ellipsis(leaf):
                            found.append(f"{callee}(...)")
                        elif isinstance(leaf, ast.Name) and leaf.id in placeholders and leaf.id not in guarded:
                            found.append(f"{callee}({leaf.id})")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, frozenset())
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("answer = ...\nprint(check_x(ex, answer))", ["check_x(answer)"]),
        ("print(check_x(ex, ...))", ["check_x(...)"]),
        ("n = ...\nm = ...\nprint(check_x(ex, n, [m]))", ["check_x(n)", "check_x(m)"]),
        ("answer = ...\nif answer is ...:\n    print('write it')\nelse:\n    print(check_x(answer))", []),
        ("answer = ...\nif answer is not ...:\n    print(check_x(answer))", []),
        ("a = ...\nb = ...\nif a is not ... and b is not ...:\n    check_x(a, b)", []),
        ("a = ...\nb = ...\nif a is not ...:\n    check_x(a, b)", ["check_x(b)"]),
        ("a = ...\nb = ...\nif a is ... or b is ...:\n    pass\nelse:\n    check_x(a, b)", []),
        (
            "a = ...\nb = ...\nif a is ... and b is ...:\n    pass\nelse:\n    check_x(a, b)",
            ["check_x(a)", "check_x(b)"],
        ),
        ("a = ...\nb = ...\nif a is not ... or b is not ...:\n    check_x(a, b)", ["check_x(a)", "check_x(b)"]),
        ("answer = ...\nif answer is ...:\n    check_x(answer)", ["check_x(answer)"]),
        ("answer = my_kernel\nprint(check_x(answer, launch))", []),
        ("def k(x):\n    y = 1\n    # TODO: the rest\nprint(check_x(k, launch))", ["check_x(k)"]),
        ("def f(x):\n    ...\nprint(check_x((f, g), launch))", ["check_x(f)"]),
        ("def f(x):\n    ...\nanswer = ...\nif answer is not ...:\n    check_x(answer)", []),
        ("def f(x):\n    return x + 1\nprint(check_x(f))", []),
    ],
)
def test_the_scan_tells_guarded_from_unguarded_checks(source: str, expected: list[str]) -> None:
    assert unguarded_checks(source) == expected


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_no_checker_grades_an_unanswered_exercise_on_run_all(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    offenders = {
        cell.get("id", str(index)): calls
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (calls := unguarded_checks(cell.source))
    }
    assert not offenders, f"{notebook.name}: cells whose checker runs before the student answers: {offenders}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_no_cell_is_empty(notebook: Path) -> None:
    """An empty cell shows as a stray "Type Markdown and LaTeX" box or an empty prompt."""
    nb = nbformat.read(notebook, as_version=4)
    empty = [cell.get("id", str(index)) for index, cell in enumerate(nb.cells) if not cell.source.strip()]
    assert not empty, f"{notebook.name}: empty cells {empty}"
