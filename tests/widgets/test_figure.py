"""show_figure / ThemedFigure: a matplotlib figure in a light and a dark rendering, shown by theme."""

from __future__ import annotations

import base64
import io
import re
from unittest import mock

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pagedkv.widgets import ThemedFigure, show_figure  # noqa: E402
from pagedkv.widgets.figure import (  # noqa: E402
    DARK_BACKGROUND,
    GRAPHIC_CONTRAST,
    TEXT_CONTRAST,
    contrast,
    dark_color,
)


def figure() -> tuple[plt.Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=(4, 2), layout="constrained")
    ax.plot([0, 1, 2], [0, 1, 4], color="#0072B2", label="line")
    ax.bar([0.5, 1.5], [2, 3], color="#009E73", label="bars")
    ax.axhline(1, color="#888", linestyle="--", label="grey")
    ax.plot([1], [3], "|", color="#000")
    ax.set(title="a title", xlabel="x")
    ax.text(0.1, 3.5, "navy note", color="#000080")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig, ax


def renderings(html: str) -> dict[str, np.ndarray]:
    """{"light": pixels, "dark": pixels} of the widget's two PNGs."""
    found = re.findall(r'<img class="pkv-figure-(light|dark)"[^>]*src="data:image/png;base64,([^"]+)"', html)
    return {name: matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png") for name, data in found}


def test_two_renderings_and_the_css_that_picks_one() -> None:
    fig, _ax = figure()
    widget = ThemedFigure(fig)
    html = widget.value
    images = renderings(html)
    assert set(images) == {"light", "dark"}
    # The corner pixel is the figure's background: white in the light rendering, JupyterLab Dark's in the dark one.
    assert matplotlib.colors.to_hex(images["light"][0, 0]) == "#ffffff"
    assert matplotlib.colors.to_hex(images["dark"][0, 0]) == DARK_BACKGROUND
    # The dark one is mostly dark, the light one mostly light.
    assert images["dark"][..., :3].mean() < 0.3 < 0.8 < images["light"][..., :3].mean()
    # JupyterLab sets data-jp-theme-light on <body>; the dark image is hidden unless it says "false".
    assert ".pkv-figure .pkv-figure-dark{display:none}" in html
    assert 'body[data-jp-theme-light="false"] .pkv-figure .pkv-figure-light{display:none}' in html
    assert 'body[data-jp-theme-light="false"] .pkv-figure .pkv-figure-dark{display:block}' in html
    assert 'alt="a title"' in html
    # The HTML is the widget's state: saved with the notebook, shown when it is opened.
    assert widget.get_state()["value"] == html


def test_dark_rendering_keeps_text_and_data_readable() -> None:
    fig, ax = figure()
    ThemedFigure(fig)  # recolours fig for its dark rendering
    for text in [ax.title, ax.xaxis.label, *ax.texts, *ax.get_xticklabels(), *ax.get_legend().get_texts()]:
        assert contrast(text.get_color(), DARK_BACKGROUND) >= TEXT_CONTRAST, text.get_text()
    line, marker = ax.lines[0], ax.lines[2]
    assert contrast(line.get_color(), DARK_BACKGROUND) >= GRAPHIC_CONTRAST
    assert contrast(marker.get_markeredgecolor(), DARK_BACKGROUND) > 10  # black marker -> light grey
    assert matplotlib.colors.to_hex(ax.get_facecolor()) == DARK_BACKGROUND


def test_dark_color() -> None:
    hexed = {c: matplotlib.colors.to_hex(dark_color(c)) for c in ("#ffffff", "#000000", "#0072B2")}
    assert hexed["#ffffff"] == DARK_BACKGROUND  # a white background becomes the dark page
    assert contrast(hexed["#000000"], DARK_BACKGROUND) > 10  # black ink becomes light
    assert hexed["#0072B2"] == "#0072b2"  # already >= 3:1 on the dark background: unchanged hue and lightness
    navy = dark_color("#000080")
    assert contrast(navy, DARK_BACKGROUND) >= GRAPHIC_CONTRAST
    assert contrast(dark_color("#000080", TEXT_CONTRAST), DARK_BACKGROUND) >= TEXT_CONTRAST
    assert dark_color((1, 0, 0, 0)) == (1, 0, 0, 0)  # transparent stays transparent


def test_show_figure_displays_a_widget_and_closes_the_figure() -> None:
    fig, ax = figure()
    with mock.patch("IPython.display.display") as display:
        assert show_figure(ax) is None  # an Axes works too; None: a last-line call shows it once
    (widget,), _ = display.call_args
    assert isinstance(widget, ThemedFigure)
    assert repr(widget) == "ThemedFigure('a title', 1 axes)"  # stable text for nbval, no PNG bytes
    assert not plt.fignum_exists(fig.number)  # the inline backend does not show a second, white copy
    with pytest.raises(TypeError, match="matplotlib Figure or Axes"):
        ThemedFigure("not a figure")  # type: ignore[arg-type]


def test_transparent_figure_gets_a_light_background() -> None:
    # Jupyter's inline backend makes figures transparent: the light rendering must not be.
    with matplotlib.rc_context({"figure.facecolor": (1, 1, 1, 0)}):
        fig, _ax = figure()
    images = renderings(ThemedFigure(fig).value)
    assert images["light"][0, 0, 3] == 1.0 and matplotlib.colors.to_hex(images["light"][0, 0]) == "#ffffff"


def test_display_falls_back_to_the_light_png_where_widgets_are_not_drawn() -> None:
    """An untrusted notebook (opened, never run on this server), nbviewer, GitHub: no widget, the image."""
    fig, _ax = figure()
    widget = ThemedFigure(fig)
    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/plain"] == repr(widget)
    light = renderings(widget.value)["light"]
    fallback = matplotlib.image.imread(io.BytesIO(base64.b64decode(bundle["image/png"])), format="png")
    assert np.array_equal(fallback, light)


def test_dark_bars_are_lightened_and_the_suptitle_names_the_figure() -> None:
    fig, ax = plt.subplots(figsize=(3, 2))
    bars = ax.bar([0, 1], [1, 2], color="#000080")  # navy: 1.3:1 on the dark background
    fig.suptitle("navy bars")
    widget = ThemedFigure(fig)
    assert all(contrast(bar.get_facecolor(), DARK_BACKGROUND) >= GRAPHIC_CONTRAST for bar in bars)
    assert repr(widget) == "ThemedFigure('navy bars', 1 axes)"
