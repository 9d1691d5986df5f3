"""`StepPlayer`: a slider and a play button over a trace, driving any number of views."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets

from pagedkv.trace import StepRecord, StepTrace
from pagedkv.widgets.common import MIN_FRAME_S, LiveRedraw, TraceView, slider_position


class StepPlayer(ipywidgets.VBox):
    """Scrub through a recorded (or still recording) run; every view shows the chosen step.

    The Play button and the slider are linked in the browser; each slider move reaches the
    kernel, which renders every view at that step and only then updates the views and the
    label together, so the label always names the step the views show. While the trace is still
    recording, a player whose slider sits on the last step follows the new steps (in a running
    notebook cell each shown at least `min_frame_s`, as a view following a run; see LiveRedraw).
    One left on an earlier step updates its label's step count, and redraws views of the whole
    run (a `PlotView`) when the cell ends: a player whose cell was run again still exists, so it
    must cost next to nothing per step.
    `close()` stops it following the trace.
    """

    _stop_observing: Callable[[], None] = staticmethod(lambda: None)
    """Set once the player observes its trace (a failed __init__ has nothing to stop)."""

    def __init__(
        self,
        trace: StepTrace,
        views: Sequence[TraceView] = (),
        *,
        interval_ms: int = 700,
        min_frame_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        others = [type(view).__name__ for view in views if view.trace is not trace]
        if others:
            raise ValueError(
                f"{others[0]} draws another trace than the player's: build the views on the "
                "trace you pass to StepPlayer, so that the label and the views show the same run."
            )
        self.trace = trace
        self.views = list(views)
        last = max(len(trace) - 1, 0)
        self.play = ipywidgets.Play(min=0, max=last, value=0, interval=interval_ms, description="play")
        self.slider = ipywidgets.IntSlider(
            min=0, max=last, value=0, readout=False, description="step", continuous_update=True
        )
        self.slider.add_class("pkv-step-slider")
        ipywidgets.jslink((self.play, "value"), (self.slider, "value"))
        self.label = ipywidgets.HTML()
        controls = ipywidgets.HBox([self.play, self.slider, self.label])
        super().__init__([controls, *(w for view in self.views for w in (*view.controls, view))], **kwargs)
        self.add_class("pkv-step-player")
        self._following = self.slider.value == self.slider.max
        """Whether the slider sat on the last step when it last moved: new steps then move it on."""
        self.slider.observe(self._on_slider, "value")
        self._live = LiveRedraw(self._show_newest, min_frame_s=MIN_FRAME_S if min_frame_s is None else min_frame_s)
        self._whole_run = LiveRedraw(self._redraw_whole_run, at_cell_end_only=True)
        self._stop_observing = trace.observe(self._on_new_step)
        self._show(0)

    @property
    def index(self) -> int:
        return self.slider.value

    @index.setter
    def index(self, value: int) -> None:
        """Show step `value` (-1: the newest, as for a view)."""
        self.slider.value = slider_position(value, len(self.trace))

    def close(self) -> None:
        """Stop following the trace, then close the player (not its views: they have their own `close`)."""
        self._stop_observing()
        super().close()

    def _on_slider(self, change: dict[str, int]) -> None:
        self._following = change["new"] == self.slider.max
        self._show(change["new"])

    def _on_new_step(self, _record: StepRecord) -> None:
        self.slider.max = self.play.max = len(self.trace) - 1
        if self._following:
            self._live.new_step()
        else:  # the same step stays on display: its label's count and plots of the whole run change
            self.label.value = self._label(self.slider.value)
            self._whole_run.new_step()

    def _show_newest(self) -> None:
        if self.slider.value != self.slider.max:
            self.slider.value = self.slider.max  # _on_slider draws every view
        else:  # the first step (index 0 before and after): the views still say "waiting"
            self._show(self.slider.value)

    def _redraw_whole_run(self) -> None:
        index = self.slider.value
        for view in self.views:
            if view.draws_whole_run:
                view.show(index, view.html_at(index))

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
