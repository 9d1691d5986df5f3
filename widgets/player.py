"""`StepPlayer`: a slider and a play button over a trace, driving any number of views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets

from pagedkv.trace import StepRecord, StepTrace
from pagedkv.widgets.common import TraceView


class StepPlayer(ipywidgets.VBox):
    """Scrub through a recorded (or still recording) run; every view shows the chosen step.

    The Play button and the slider are linked in the browser; each slider move reaches the
    kernel, which renders every view at that step and only then updates the views and the
    label together, so the label always names the step the views show. While the trace is still
    recording, a player whose slider sits on the last step follows the new steps.
    """

    def __init__(
        self, trace: StepTrace, views: Sequence[TraceView] = (), *, interval_ms: int = 700, **kwargs: Any
    ) -> None:
        self.trace = trace
        self.views = list(views)
        last = max(len(trace) - 1, 0)
        self.play = ipywidgets.Play(min=0, max=last, value=0, interval=interval_ms, description="play")
        self.slider = ipywidgets.IntSlider(min=0, max=last, value=0, readout=False, description="step",
                                           continuous_update=True)
        self.slider.add_class("pkv-step-slider")
        ipywidgets.jslink((self.play, "value"), (self.slider, "value"))
        self.label = ipywidgets.HTML()
        controls = ipywidgets.HBox([self.play, self.slider, self.label])
        super().__init__([controls, *(w for view in self.views for w in (*view.controls, view))], **kwargs)
        self.add_class("pkv-step-player")
        self.slider.observe(lambda change: self._show(change["new"]), "value")
        trace.observe(self._on_new_step)
        self._show(0)

    @property
    def index(self) -> int:
        return self.slider.value

    @index.setter
    def index(self, value: int) -> None:
        self.slider.value = value

    def _on_new_step(self, _record: StepRecord) -> None:
        following = self.slider.value == self.slider.max
        last = len(self.trace) - 1
        self.slider.max = self.play.max = last
        if following and self.slider.value != last:
            self.slider.value = last  # the observer redraws
        else:
            self._show(self.slider.value)

    def _show(self, index: int) -> None:
        # Render every view first (the slow part: SVG strings, a PlotView's PNG), then hand the
        # results to the views and the label in one go. Setting each view as soon as it was
        # rendered sent the label last, after the slowest render: while playing, the browser
        # showed new views under the old step's label (or the reverse) for most of each interval.
        pages = [view.html_at(index) for view in self.views]
        label = self._label(index)
        for view, html in zip(self.views, pages):
            view.show(index, html)
        self.label.value = label

    def _label(self, index: int) -> str:
        if not self.trace.steps:
            return "<code>no steps yet</code>"
        record = self.trace[index]
        return (
            f'<code class="pkv-step-label" data-step="{record.step}">step {record.step}</code> '
            f"({index + 1} of {len(self.trace)})"
        )

    def __repr__(self) -> str:
        names = ", ".join(type(v).__name__ for v in self.views)
        return f"StepPlayer({len(self.trace)} steps, at index {self.index}, views=[{names}])"
