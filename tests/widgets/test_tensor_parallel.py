"""The tensor-parallel view's dropdowns show every choice whole, whichever is picked."""

from __future__ import annotations

import ipywidgets
import pytest
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

from pagedkv.widgets import TensorParallelLayoutView

# JupyterLab's defaults for a dropdown that sets neither (--jp-widgets-inline-width and
# --jp-widgets-inline-label-width), and what it draws beside the text: the label's right margin
# (8 px), the select's left padding (8 px), its arrow (20 px) and its border (2 px).
DEFAULT_WIDTH_PX, DEFAULT_LABEL_PX, CHROME_PX = 300, 80, 8 + 8 + 20 + 2
FONT_PX = 13  # --jp-widgets-font-size


def text_px(text: str) -> float:
    """Width of `text` in DejaVu Sans at 13 px: a wide sans-serif, so a font the browser picks
    instead (Liberation Sans, Arial, Helvetica) needs no more room."""
    points = FONT_PX * 72 / 96
    width, _, _ = TextToPath().get_text_width_height_descent(
        text, FontProperties(family="DejaVu Sans", size=points), ismath=False
    )
    return width * 96 / 72


def px(value: str | None, default: int) -> float:
    if not value:
        return default
    assert value.endswith("px"), f"a width the test cannot measure: {value!r}"
    return float(value.removesuffix("px"))


def room_px(dropdown: ipywidgets.Dropdown) -> float:
    """Pixels left for the picked choice's text inside the select box."""
    width = px(dropdown.layout.width, DEFAULT_WIDTH_PX)
    return width - px(dropdown.style.description_width, DEFAULT_LABEL_PX) - CHROME_PX


@pytest.mark.parametrize("control", ["shape", "tp"])
def test_every_choice_fits_its_dropdown(control: str) -> None:
    dropdown = getattr(TensorParallelLayoutView(), control)
    room = room_px(dropdown)
    cut = {label: round(text_px(str(label))) for label in dropdown.options if text_px(str(label)) > room}
    assert not cut, f"{control}: {round(room)} px of room, these choices need more: {cut}"


def test_dejavu_measure_is_wide_enough() -> None:
    # The reference measure itself, by hand: 13 px DejaVu Sans digits are 8.27 px each
    # (1303 of 2048 font units); ten of them are 82.7 px.
    assert text_px("0123456789") == pytest.approx(82.7, abs=0.2)
