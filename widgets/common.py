"""What every view shares: the `TraceView` base class and the request colours."""

from __future__ import annotations

import html
import zlib
from typing import TYPE_CHECKING, Any

import ipywidgets
import traitlets

from pagedkv.trace import EngineInfo, StepRecord, StepTrace

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

# Colour-blind friendly (Okabe-Ito + Tol) and dark enough for text on white.
# Request i gets the same colour in every view.
PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9",
    "#D55E00", "#999933", "#332288", "#882255", "#AA4499",
)
# The HTML widget's container does not wrap lines and has a tall line height: undo both.
BASE_STYLE = (
    "font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; "
    "white-space: normal; line-height: 1.35; max-width: 980px"
)


def request_color(req_id: str) -> str:
    """A fixed colour per request id (crc32, not hash(): str hashes change between runs)."""
    index = int(req_id) if req_id.isdigit() else zlib.crc32(req_id.encode())
    return PALETTE[index % len(PALETTE)]


def esc(value: object) -> str:
    """Text made safe for HTML / SVG."""
    return html.escape(str(value), quote=True)


def short_layer(name: str) -> str:
    """"model.layers.3.self_attn.attn" -> "layers.3" (the part that differs between layers)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers":
            return f"layers.{parts[i + 1]}"
    return name


class TraceView(ipywidgets.HTML):
    """One step of a `StepTrace` drawn as HTML/SVG; `index` picks the step.

    `index = -1` follows the newest step, so a view attached to a running engine redraws
    after every step; a `StepPlayer` sets concrete indices instead. Subclasses only write
    `render(record)`: the same code draws a live step and a replayed one.
    """

    index = traitlets.Int(-1, help="Index into trace.steps; -1 = the newest step.")
    needs_step = True
    """False for views that can draw start-up facts before the first step."""

    def __init__(self, trace: StepTrace, *, index: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace = trace
        self.index = index
        self.observe(lambda _change: self.redraw(), "index")
        trace.observe(self._on_new_step)
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

    def _on_new_step(self, _record: StepRecord) -> None:
        if self.index == -1:
            self.redraw()

    def redraw(self) -> None:
        record = self.record
        if record is None and self.needs_step:
            name = esc(type(self).__name__)
            self.value = f'<div style="{BASE_STYLE}; color: #666">{name}: waiting for the first step.</div>'
        else:
            self.value = self.render(record)

    def render(self, record: StepRecord) -> str:
        """HTML for one step (None only when `needs_step` is False and no step ran yet)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        record = self.record
        where = "no steps yet" if record is None else f"step {record.step}, {len(self.trace)} recorded"
        return f"{type(self).__name__}({where})"
