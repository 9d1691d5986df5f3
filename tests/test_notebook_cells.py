"""The workbook's code cells fit the column a student reads them in.

A student's run in JupyterLab + Chromium at a 1280 px window with the file browser open found 79
of the workbook's 227 code cells scrolling sideways (issue 46); 80 of them had a line of more than
107 characters, so about 107 fit. The browser test (tests/browser/test_jupyterlab.py) checks the
rendered editors; this test holds the rule without a browser, with a margin: no line of a code
cell longer than `MAX_LINE` characters.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_LINE = 100


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_code_line_scrolls_sideways(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    long = [
        f"cell {i} line {n}: {len(line)} characters: {line.strip()[:60]!r}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for n, line in enumerate(cell.source.splitlines(), start=1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"{path.name}: code lines over {MAX_LINE} characters:\n" + "\n".join(long)
