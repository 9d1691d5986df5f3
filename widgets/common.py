"""What every view shares: the `TraceView` base class and the request colours."""

from __future__ import annotations

import html
import os
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets
import traitlets

from pagedkv.checks import check_float
from pagedkv.trace import EngineInfo, StepRecord, StepTrace

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

# Request colours: mid-luminance hues (Okabe-Ito and Tol, darkest and lightest swapped out), each
# with a contrast of at least 3:1 against both JupyterLab backgrounds (white and #212121), so a
# request's border or tick reads in the light and the dark theme. Text is never drawn in them.
PALETTE = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#7B68EE",
    "#B8860B",
    "#17A2B8",
    "#C2417A",
    "#999933",
    "#9467BD",
)
# JupyterLab theme variables, so every view follows the light / dark theme. The fallbacks are CSS
# system colours, which follow the page's colour scheme outside JupyterLab.
FG = "var(--jp-ui-font-color1, CanvasText)"
"""Body text."""
FG_MUTED = "var(--jp-ui-font-color2, GrayText)"
"""Secondary text: legends, small labels (still >= 4.5:1 on BG in both themes)."""
BG = "var(--jp-layout-color1, Canvas)"
"""The notebook's background: free blocks, empty slots."""
BG_HEADER = "var(--jp-layout-color2, Canvas)"
"""Table headers and padding cells."""
BG_SOLID = "var(--jp-layout-color3, GrayText)"
"""Something that is never handed out: the null block."""
BORDER = "var(--jp-border-color1, GrayText)"
BORDER_LIGHT = "var(--jp-border-color2, GrayText)"
ACCENT = "var(--jp-brand-color1, LinkText)"
"""The step cursor / the item the text talks about."""
# The HTML widget's container does not wrap lines and has a tall line height: undo both. Never
# wider than the output area (~850 px at a 1280 px window with JupyterLab's file browser open).
BASE_STYLE = (
    "font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; "
    f"white-space: normal; line-height: 1.35; max-width: 100%; box-sizing: border-box; color: {FG}"
)
FIT_CSS = "<style>.pkv-view{min-width:0;max-width:100%}.pkv-view>.widget-html-content{min-width:0}</style>"
"""Lets a view's HTML widget shrink to its output area: ipywidgets' HTML content is a flex item,
which by default is never narrower than its content (a wide table would push past the edge)."""
SVG_STYLE = f"color: {FG}; fill: currentColor"
"""On an <svg>: its <text> elements inherit the theme's text colour (SVG's default fill is black)."""


LIVE_REDRAW_INTERVAL_S = 0.25
"""With `min_frame_s=0`: while a notebook cell runs, a view following the engine redraws at most
this often, and the newest step is drawn when the cell ends. Redrawing after every step made the
browser re-lay out the whole view each time, on the cores the kernel needs: on 2 CPU cores that
took notebook 09's serve cell from 1.2 s to 3.3 s."""
MIN_FRAME_S = float(os.environ.get("PAGEDKV_MIN_FRAME_S", "0.25"))
"""Default minimum frame time of a view following a run in a notebook: every step is drawn and
stays on screen at least this long (the engine waits), so a student watching generate() sees each
step (20 steps: 5 s) rather than only the last. The environment variable PAGEDKV_MIN_FRAME_S sets
it (0 for CI: the old behaviour, skip frames and draw the newest step when the cell ends)."""


def _ipython() -> Any:
    """The running IPython shell (a notebook kernel), or None in a plain Python process."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def request_color(req_id: str) -> str:
    """A fixed colour per request id (crc32, not hash(): str hashes change between runs)."""
    index = int(req_id) if req_id.isdigit() else zlib.crc32(req_id.encode())
    return PALETTE[index % len(PALETTE)]


def esc(value: object) -> str:
    """Text made safe for HTML / SVG."""
    return html.escape(str(value), quote=True)


def short_layer(name: str) -> str:
    """ "model.layers.3.self_attn.attn" -> "layers.3" (the part that differs between layers)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers":
            return f"layers.{parts[i + 1]}"
    return name


DROPDOWN_CHROME_PX = 8 + 8 + 20 + 2
"""What JupyterLab draws beside a dropdown's text: the label's right margin, the select's left
padding, its arrow and its border."""
DROPDOWN_CHAR_PX = 9
"""Room per character of a choice: JupyterLab's 13 px text in a wide sans-serif (DejaVu Sans)
averages under 7 px a character and 8.3 px a digit (the whole of a short choice like "16")."""


def dropdown_size(chars: int, label_px: int) -> dict[str, Any]:
    """`ipywidgets.Dropdown` keywords for a box wide enough for a choice of `chars` characters
    beside a label of `label_px` (ipywidgets' default 300 px cuts longer choices), at most 900 px."""
    width = min(label_px + DROPDOWN_CHROME_PX + DROPDOWN_CHAR_PX * chars, 900)
    return {"style": {"description_width": f"{label_px}px"}, "layout": ipywidgets.Layout(width=f"{width}px")}


def step_index_error(index: int, num_steps: int) -> IndexError:
    """The error for a step index outside a trace of `num_steps` steps (views and players)."""
    return IndexError(
        f"index {index} is out of range for a trace of {num_steps} steps: use "
        f"0..{max(num_steps - 1, 0)}, or -1 for the newest step."
    )


def slider_position(index: int, num_steps: int) -> int:
    """Where a step slider goes for step `index` (-1: the newest) of `num_steps`; an IndexError
    (`step_index_error`) outside them. A slider over no steps yet sits at 0."""
    if not -max(num_steps, 1) <= index < max(num_steps, 1):
        raise step_index_error(index, num_steps)
    return index % max(num_steps, 1)


class LiveRedraw:
    """Runs `draw` after a new step: at once in a plain Python process (no one watches). While a
    notebook cell runs:

    - `min_frame_s > 0`: after every step, waiting first until the previous frame has been on
      screen `min_frame_s` (the engine's next step waits too: a run can be watched step by step);
    - `min_frame_s == 0`: at most every LIVE_REDRAW_INTERVAL_S, and once more when the cell ends
      (so the newest step is what stays on screen);
    - `at_cell_end_only`: only when the cell ends.
    """

    def __init__(self, draw: Callable[[], None], at_cell_end_only: bool = False, min_frame_s: float = 0.0) -> None:
        self.draw = draw
        self.at_cell_end_only = at_cell_end_only
        self.min_frame_s = check_float("min_frame_s", min_frame_s, 0, hint=" (seconds)")
        self.drawn_at = float("-inf")
        """`time.monotonic()` when `draw` last ran."""
        self.waiting = False
        """True while a draw waits for the end of the running cell."""

    def new_step(self) -> None:
        shell = _ipython()
        if shell is None:
            self._run()
            return
        if self.min_frame_s > 0 and not self.at_cell_end_only:
            wait = self.drawn_at + self.min_frame_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._run()
            return
        due = not self.at_cell_end_only and time.monotonic() - self.drawn_at >= LIVE_REDRAW_INTERVAL_S
        if due:
            self._run()
        elif not self.waiting:  # skip this step's drawing; draw the newest one when the cell ends
            self.waiting = True
            shell.events.register("post_run_cell", self._catch_up)

    def _run(self) -> None:
        self.draw()
        self.drawn_at = time.monotonic()

    def _catch_up(self, *_: Any) -> None:
        _ipython().events.unregister("post_run_cell", self._catch_up)  # IPython iterates over a copy
        self.waiting = False
        self._run()


class TraceView(ipywidgets.HTML):
    """One step of a `StepTrace` drawn as HTML/SVG; `index` picks the step.

    `index = -1` follows the newest step, so a view attached to a running engine redraws
    after every step, each frame shown at least `min_frame_s` seconds in a notebook (default
    MIN_FRAME_S; see LiveRedraw); a `StepPlayer` sets concrete indices instead. Subclasses only write
    `render(record)`: the same code draws a live step and a replayed one. `close()` stops a
    view from following its trace (a view that is only deleted in a notebook stays registered
    with ipywidgets, and so with its trace).
    """

    index = traitlets.Int(-1, help="Index into trace.steps; -1 = the newest step.")
    needs_step = True
    """False for views that can draw start-up facts before the first step."""
    draws_whole_run = False
    """True for views whose drawing of a step changes as the run grows (a plot of the whole run)."""
    _quiet = False
    """True while `show` sets `index` for HTML it already rendered: no second render."""
    _stop_observing: Callable[[], None] = staticmethod(lambda: None)
    """Set once the view observes its trace (a failed __init__ has nothing to stop)."""

    def __init__(self, trace: StepTrace, *, index: int = -1, min_frame_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_class("pkv-view")
        self.trace = trace
        self.index = index
        self.observe(self._on_index, "index")
        self._live = LiveRedraw(self._draw_newest, min_frame_s=MIN_FRAME_S if min_frame_s is None else min_frame_s)
        self._stop_observing = trace.observe(self._on_new_step)
        self.redraw()

    @classmethod
    def attach(cls, llm: LLM, **kwargs: Any) -> TraceView:
        """A view on a new `StepTrace` recording `llm`: it redraws while `generate` runs."""
        return cls(StepTrace.attach(llm), **kwargs)

    @property
    def engine(self) -> EngineInfo:
        return self.trace.engine

    @property
    def record(self) -> StepRecord | None:
        """The step on display, or None while the trace is still empty."""
        if not self.trace.steps:
            return None
        return self.trace.steps[self.index]

    @property
    def controls(self) -> tuple[ipywidgets.Widget, ...]:
        """Widgets of this view drawn above it (a page slider, say); a `StepPlayer` shows them too."""
        return ()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        # `display(view)` shows the view's own controls above it.
        if not self.controls:
            return super()._repr_mimebundle_(**kwargs)
        return ipywidgets.VBox([*self.controls, self])._repr_mimebundle_(**kwargs)

    @traitlets.validate("index")
    def _check_index(self, proposal: dict[str, Any]) -> int:
        index, n = proposal["value"], len(self.trace)
        if index != -1 and not 0 <= index < max(n, 1):  # 0 on an empty trace: the first step, once it runs
            raise step_index_error(index, n)
        return index

    def _on_index(self, _change: dict[str, Any]) -> None:
        if not self._quiet:
            self.redraw()

    def _on_new_step(self, _record: StepRecord) -> None:
        if self.index == -1:
            self._live.new_step()

    def _draw_newest(self) -> None:
        if self.index == -1:  # still following when a deferred draw comes due
            self.redraw()

    def close(self) -> None:
        """Stop following the trace, then close the widget."""
        self._stop_observing()
        super().close()

    def html_at(self, index: int) -> str:
        """The HTML of step `index` (-1 = newest), rendered but not shown."""
        record = self.trace.steps[index] if self.trace.steps else None
        if record is None and self.needs_step:
            name = esc(type(self).__name__)
            return f'<div style="{BASE_STYLE}; color: {FG_MUTED}">{name}: waiting for the first step.</div>{FIT_CSS}'
        return self.render(record) + FIT_CSS

    def redraw(self) -> None:
        self.value = self.html_at(self.index)

    def show(self, index: int, html: str) -> None:
        """Display `html`, rendered earlier by `html_at(index)`, and set `index` without rendering again.

        `StepPlayer` renders every view first and then shows them all at once, so the browser
        receives the new step of every view (and the label) back to back.
        """
        self._quiet = True
        try:
            self.index = index
        finally:
            self._quiet = False
        self.value = html

    def render(self, record: StepRecord) -> str:
        """HTML for one step (None only when `needs_step` is False and no step ran yet)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        record = self.record
        where = "no steps yet" if record is None else f"step {record.step}, {len(self.trace)} recorded"
        return f"{type(self).__name__}({where})"
