"""Figure text in the notebooks is readable: at least 10 px on the page.

`show_figure` renders a figure at its `dpi` (80 by default) and the page shows the PNG at that size
(it only shrinks one wider than the column), so a font of N points is N * dpi / 72 pixels: 7 points
were 7.8 px, too small to read. The notebooks' code is read, not run: every literal `fontsize=` or
`labelsize=` (a number, or a named size relative to matplotlib's default 10 points) must come out at
10 px or more at the dpi the cell passes to `show_figure`, or its default.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import matplotlib
import nbformat
import pytest
from matplotlib.font_manager import font_scalings

from pagedkv.widgets import show_figure

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MIN_PX = 10.0
DEFAULT_DPI = float(inspect.signature(show_figure).parameters["dpi"].default)
SIZE_KEYWORDS = {"fontsize", "labelsize", "size"}


def _points(node: ast.expr) -> float | None:
    """The size in points of a literal font size (a number or a name like "small"), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Constant) and node.value in font_scalings:
        return font_scalings[node.value] * float(matplotlib.rcParamsDefault["font.size"])
    return None


def small_text(source: str) -> list[str]:
    """The literal font sizes of a cell that render below MIN_PX, as "keyword=value (px)" strings."""
    tree = ast.parse(source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    dpis = [
        keyword.value.value
        for call in calls
        if isinstance(call.func, ast.Name) and call.func.id == "show_figure"
        for keyword in call.keywords
        if keyword.arg == "dpi" and isinstance(keyword.value, ast.Constant)
    ]
    dpi = float(min(dpis, default=DEFAULT_DPI))
    found = []
    for call in calls:
        for keyword in call.keywords:
            points = _points(keyword.value) if keyword.arg in SIZE_KEYWORDS else None
            if points is not None and points * dpi / 72 < MIN_PX:
                found.append(f"{keyword.arg}={ast.unparse(keyword.value)} ({points * dpi / 72:.1f} px)")
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("ax.legend(fontsize=7)\nshow_figure(fig)", ["fontsize=7 (7.8 px)"]),
        ('ax.tick_params(labelsize="small")\nshow_figure(fig)', ["labelsize='small' (9.3 px)"]),
        ("ax.legend(fontsize=9)\nax.set_title('t', fontsize=11)\nshow_figure(fig)", []),
        ("ax.legend(fontsize=9)\nshow_figure(fig, dpi=60)", ["fontsize=9 (7.5 px)"]),
        ("ax.legend(fontsize=size)\nshow_figure(fig)", []),  # not a literal: not judged
    ],
)
def test_the_scan_converts_points_to_pixels(source: str, expected: list[str]) -> None:
    assert small_text(source) == expected


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_figure_text_is_at_least_10_px(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    offenders = {
        cell.get("id", str(index)): sizes
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        and not cell.source.lstrip().startswith(("%", "!"))
        and (sizes := small_text(cell.source))
    }
    assert not offenders, f"{notebook.name}: figure text under {MIN_PX:g} px: {offenders}"
