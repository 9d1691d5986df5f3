"""`show_figure`: a matplotlib figure that follows the JupyterLab theme (light or dark).

A PNG cannot change colour with the page, so the figure is drawn twice: as it is (light) and
recoloured for a dark page (greys inverted, colours lightened until they stand out from the dark
background). Both go into one `ipywidgets.HTML` with a `<style>` that shows the rendering matching
`body[data-jp-theme-light]`, the attribute JupyterLab sets on every theme change. The HTML is
the widget's state, so a notebook saved with widget state shows the figure when it is opened,
and switching the theme needs no kernel. Outside JupyterLab (no such attribute) the page's
`prefers-color-scheme` picks one.
"""

from __future__ import annotations

import base64
import colorsys
import io
from typing import Any

import ipywidgets
import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import Collection
from matplotlib.colors import to_hex, to_rgba
from matplotlib.figure import Figure, SubFigure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text

RGBA = tuple[float, float, float, float]

LIGHT_BACKGROUND = "#ffffff"
"""A figure's background in the light rendering (JupyterLab Light's --jp-layout-color1)."""
DARK_BACKGROUND = "#212121"
"""A figure's background in the dark rendering (JupyterLab Dark's --jp-layout-color1)."""
DARK_FOREGROUND_LIGHTNESS = 0.88
"""What black text and axes become in the dark rendering (#e0e0e0: 13:1 on DARK_BACKGROUND)."""
TEXT_CONTRAST = 4.5
"""WCAG AA for text: a label's colour against the dark background after recolouring."""
GRAPHIC_CONTRAST = 3.0
"""WCAG AA for graphics (lines, bars, markers) against the dark background."""

_STYLE = (
    "<style>"
    ".pkv-figure img{max-width:100%;height:auto;display:block}"
    ".pkv-figure .pkv-figure-dark{display:none}"
    'body[data-jp-theme-light="false"] .pkv-figure .pkv-figure-light{display:none}'
    'body[data-jp-theme-light="false"] .pkv-figure .pkv-figure-dark{display:block}'
    "@media (prefers-color-scheme: dark){"
    "body:not([data-jp-theme-light]) .pkv-figure .pkv-figure-light{display:none}"
    "body:not([data-jp-theme-light]) .pkv-figure .pkv-figure-dark{display:block}}"
    "</style>"
)
"""Shows one rendering per theme; the same rule for every figure, so repeating it is harmless."""


def _luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG relative luminance of an sRGB colour with channels in 0..1."""

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: Any, b: Any) -> float:
    """WCAG contrast ratio of two opaque matplotlib colours (1 to 21)."""
    la, lb = sorted((_luminance(to_rgba(a)[:3]), _luminance(to_rgba(b)[:3])), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def dark_color(color: Any, minimum: float = GRAPHIC_CONTRAST) -> RGBA:
    """The colour to draw `color` with on DARK_BACKGROUND.

    Greys (white, black and between) swap lightness, so they keep their contrast with the page:
    a white background becomes DARK_BACKGROUND, black text light grey, a pale grey fill a dark
    one. A colour keeps its hue and is lightened only as far as it needs to reach `minimum`
    contrast against the dark background. Text (`minimum` TEXT_CONTRAST) always reaches it.
    Transparent stays transparent.
    """
    r, g, b, a = to_rgba(color)
    if a == 0:
        return (r, g, b, a)
    h, lightness, s = colorsys.rgb_to_hls(r, g, b)
    grey = s < 0.15 or lightness > 0.95 or lightness < 0.05
    if grey:  # mirror it between the two ends
        dark_l = colorsys.rgb_to_hls(*to_rgba(DARK_BACKGROUND)[:3])[1]
        lightness, s = dark_l + (DARK_FOREGROUND_LIGHTNESS - dark_l) * (1 - lightness), 0.0
    rgb = colorsys.hls_to_rgb(h, lightness, s)
    if not grey or minimum >= TEXT_CONTRAST:  # lighten until it stands out from the background
        while contrast(rgb, DARK_BACKGROUND) < minimum and lightness < 1:
            lightness = min(lightness + 0.02, 1.0)
            rgb = colorsys.hls_to_rgb(h, lightness, s)
    return (*rgb, a)


def _background(color: Any) -> RGBA:
    """A background's dark colour (what the rest is measured against: never lightened)."""
    return dark_color(color, minimum=1.0)


def _recolor(artist: Artist) -> None:
    """Recolour one artist for the dark rendering, in place (each artist once: the mapping is not
    idempotent, a grey mirrored twice is back where it started)."""
    if isinstance(artist, Text):
        artist.set_color(dark_color(artist.get_color(), TEXT_CONTRAST))
    elif isinstance(artist, Line2D):
        # Read the marker colours before set_color: "auto" ones follow the line's colour.
        face, edge = artist._markerfacecolor, artist._markeredgecolor
        artist.set_color(dark_color(artist.get_color()))
        if not (isinstance(face, str) and face in ("none", "auto")):
            artist.set_markerfacecolor(dark_color(face))
        if not (isinstance(edge, str) and edge in ("none", "auto")):
            artist.set_markeredgecolor(dark_color(edge))
    elif isinstance(artist, Patch):  # bars, spans, spines, legend handles (backgrounds are set apart)
        artist.set_facecolor(dark_color(artist.get_facecolor()))
        artist.set_edgecolor(dark_color(artist.get_edgecolor()))
    elif isinstance(artist, Collection):
        faces, edges = artist.get_facecolor(), artist.get_edgecolor()
        if len(faces) and artist.get_array() is None:  # a colormapped collection keeps its colormap
            artist.set_facecolor([dark_color(c) for c in faces])
        if len(edges) and not isinstance(edges, str):
            artist.set_edgecolor([dark_color(c) for c in edges])


def _dark(fig: Figure) -> None:
    """Recolour the whole figure for a dark page: backgrounds, axes, ticks, texts, legends, data."""
    fig.set_facecolor(DARK_BACKGROUND)
    backgrounds = {id(fig.patch)}
    tick_marks: set[int] = set()
    for ax in fig.axes:
        ax.set_facecolor(_background(ax.get_facecolor()))
        backgrounds.add(id(ax.patch))
        # Tick marks through tick_params, so ticks made at draw time get the colour too; their
        # labels are Text below (each keeps its own colour, e.g. a request's).
        ax.tick_params(which="both", color=to_hex(dark_color("black", TEXT_CONTRAST)))
        for axis in (ax.xaxis, ax.yaxis):
            for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks()):
                tick_marks.update((id(tick.tick1line), id(tick.tick2line)))
    for sub in fig.findobj(SubFigure):
        if sub is not fig:
            sub.set_facecolor(_background(sub.get_facecolor()))
            backgrounds.add(id(sub.patch))
    for legend in fig.findobj(Legend):
        frame = legend.get_frame()
        frame.set_facecolor(DARK_BACKGROUND)
        frame.set_edgecolor(dark_color(frame.get_edgecolor()))
        backgrounds.add(id(frame))
    done = backgrounds | tick_marks
    for artist in fig.findobj(lambda a: isinstance(a, (Text, Line2D, Patch, Collection))):
        if id(artist) not in done:
            done.add(id(artist))
            _recolor(artist)


def _png(fig: Figure, dpi: float) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor=fig.get_facecolor())
    return base64.b64encode(buffer.getvalue()).decode()


def _renderings(fig: Figure, dpi: float) -> tuple[str, str]:
    """The figure as (light, dark) base64 PNGs. Draws `fig` as it is, then recolours it for the
    dark page (the figure is changed: draw it once more only after building it again)."""
    if fig.get_facecolor()[3] == 0:  # a transparent figure would show its page: make the light one white
        fig.set_facecolor(LIGHT_BACKGROUND)
    light = _png(fig, dpi)
    _dark(fig)
    return light, _png(fig, dpi)


def _html(light: str, dark: str, alt: str) -> str:
    alt_attr = alt.replace('"', "&quot;").replace("<", "&lt;")
    return (
        f'<div class="pkv-figure">{_STYLE}'
        f'<img class="pkv-figure-light" alt="{alt_attr}" src="data:image/png;base64,{light}"/>'
        f'<img class="pkv-figure-dark" alt="{alt_attr}" src="data:image/png;base64,{dark}"/></div>'
    )


def themed_figure_html(fig: Figure, *, dpi: float = 80, alt: str = "") -> str:
    """HTML with the figure's light and dark renderings, showing the one of the page's theme
    (`fig` is recoloured on the way: see `_renderings`)."""
    return _html(*_renderings(fig, dpi), alt)


def _title(fig: Figure) -> str:
    """The figure's suptitle, else its axes' titles, for the widget's repr and the images' alt text."""
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""  # matplotlib >= 3.8
    return suptitle or "; ".join(t for ax in fig.axes if (t := ax.get_title())) or "figure"


class ThemedFigure(ipywidgets.HTML):
    """A matplotlib figure as a widget that follows the JupyterLab theme (see `show_figure`).

    Its display also carries the light rendering as a plain image/png: JupyterLab draws no widget
    in an untrusted notebook (one opened from disk that was never run, or signed, on this
    server), nor do nbviewer or GitHub, and they show that image instead.
    """

    def __init__(self, fig: Figure | Axes, *, dpi: float = 80, **kwargs: Any) -> None:
        figure = _figure_of(fig)
        self.title = _title(figure)
        self.num_axes = len(figure.axes)
        self.light_png, dark = _renderings(figure, dpi)
        """The light rendering, base64: the display's image/png fallback."""
        super().__init__(_html(self.light_png, dark, self.title), **kwargs)
        self.add_class("pkv-figure-widget")
        plt.close(figure)  # a pyplot figure would be drawn once more, white, when the cell ends

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["image/png"] = self.light_png  # the widget ranks first wherever widgets are drawn
        return bundle

    def __repr__(self) -> str:  # stable text for nbval, not the PNGs
        return f"ThemedFigure({self.title!r}, {self.num_axes} axes)"


def _figure_of(fig: Figure | Axes) -> Figure:
    """The root figure of a Figure, SubFigure or Axes."""
    if not isinstance(fig, (Figure, SubFigure, Axes)):
        raise TypeError(f"show_figure draws a matplotlib Figure or Axes, got {type(fig).__name__}.")
    while not isinstance(fig, Figure):
        fig = fig.figure
    return fig


def show_figure(fig: Figure | Axes, *, dpi: float = 80) -> None:
    """Display a matplotlib figure (or the figure of an Axes) so that it follows the JupyterLab theme.

    Use it instead of `plt.show()`: the figure is shown as a widget holding a light and a dark
    rendering, and closed so the inline backend does not draw it again.
    """
    from IPython.display import display

    display(ThemedFigure(fig, dpi=dpi))
