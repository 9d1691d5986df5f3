"""Plots over a whole trace (matplotlib), and `PlotView`, which redraws one with a step cursor.

plot_kv_cache_usage(trace)      blocks in use per step, preemptions marked
plot_batch_composition(trace)   prefill vs decode tokens per step, against the token budget
plot_request_timeline(trace)    per request: waiting, prefill, decode, preempted, finished
plot_throughput(trace)          tokens per second of each step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from pagedkv.trace import StepRecord, StepTrace
from pagedkv.widgets.common import TraceView, request_color
from pagedkv.widgets.figure import LIGHT_BACKGROUND, themed_figure_html

PHASE_COLORS = {"prefill": "#0072B2", "decode": "#009E73", "unscheduled": "#cccccc"}
PlotFn = Callable[[StepTrace, Axes], Axes]
FACECOLOR = LIGHT_BACKGROUND
"""A plot brings its own opaque light background (the inline backend's default is transparent, which
leaves black labels on a dark page); `show_figure` / `PlotView` add a dark rendering for the dark theme."""
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": 8}
"""Every legend sits right of its axes, never on the data (constrained layout makes room for it)."""


def _axes(ax: Axes | None) -> Axes:
    if ax is None:
        _fig, ax = plt.subplots(figsize=(8, 2.8), layout="constrained", facecolor=FACECOLOR)
    return ax


def plot_kv_cache_usage(trace: StepTrace, ax: Axes | None = None) -> Axes:
    """Blocks held during each step, per KV cache group; the pool's size; steps that preempted."""
    ax = _axes(ax)
    steps = trace.step_numbers()
    usable = trace.engine.num_blocks - 1
    for g in range(trace.engine.num_kv_cache_groups):
        ax.step(steps, [r.num_blocks_in_use[g] for r in trace], where="mid", label=f"in use (group {g})")
    ax.axhline(usable, color="#888", linestyle="--", label=f"usable blocks ({usable})")
    preempting = [r.step for r in trace if r.preempted_req_ids]
    if preempting:
        ax.scatter(preempting, [usable] * len(preempting), marker="v", color="#D55E00", zorder=3, label="preemption")
    ax.set(xlabel="step", ylabel="blocks", title="KV cache usage")
    ax.set_ylim(0, usable * 1.15)
    ax.legend(**LEGEND_OUTSIDE)
    return ax


def plot_batch_composition(trace: StepTrace, ax: Axes | None = None) -> Axes:
    """Stacked tokens per step: decodes (1 token each) first, prefill chunks fill the budget."""
    ax = _axes(ax)
    steps = trace.step_numbers()
    decode = [r.num_decode_tokens for r in trace]
    prefill = [r.num_prefill_tokens for r in trace]
    ax.bar(steps, decode, color=PHASE_COLORS["decode"], label="decode tokens")
    ax.bar(steps, prefill, bottom=decode, color=PHASE_COLORS["prefill"], label="prefill tokens")
    budget = trace.engine.max_num_batched_tokens
    ax.axhline(budget, color="#888", linestyle="--", label=f"token budget ({budget})")
    ax.set(xlabel="step", ylabel="tokens", title="Batch composition")
    ax.legend(**LEGEND_OUTSIDE)
    return ax


def plot_request_timeline(trace: StepTrace, ax: Axes | None = None) -> Axes:
    """One row per request: what it did in each step (blank = waiting in the queue)."""
    ax = _axes(ax)
    req_ids = trace.req_ids()
    row = {r: i for i, r in enumerate(req_ids)}
    # One collection per phase and one plot call per marker kind, not an artist per cell: drawing
    # (twice in a notebook: layout, then the picture) costs per artist.
    cells: dict[str, tuple[list[int], list[float]]] = {phase: ([], []) for phase in PHASE_COLORS}
    preempted: tuple[list[float], list[int]] = ([], [])
    finished: tuple[list[float], list[int]] = ([], [])
    for record in trace:
        for r in record.requests:
            cells[r.phase][0].append(row[r.req_id])
            cells[r.phase][1].append(record.step - 0.5)
        for req_id in record.preempted_req_ids:
            preempted[0].append(record.step - 0.5)
            preempted[1].append(row[req_id])
        for req_id in record.finished_req_ids:
            finished[0].append(record.step + 0.5)
            finished[1].append(row[req_id])
    for phase, (rows, lefts) in cells.items():
        boxes = [[(x, y - 0.3), (x + 1, y - 0.3), (x + 1, y + 0.3), (x, y + 0.3)] for y, x in zip(rows, lefts)]
        ax.add_collection(PolyCollection(boxes, facecolors=PHASE_COLORS[phase], linewidths=0))
    ax.autoscale_view()
    ax.plot(*preempted, "x", color="#D55E00", markersize=9, mew=2, linestyle="")
    ax.plot(*finished, "|", color="#000", markersize=12, mew=2, linestyle="")
    ax.set_yticks(range(len(req_ids)), [f"req {r}" for r in req_ids])
    for label, req_id in zip(ax.get_yticklabels(), req_ids):
        label.set_color(request_color(req_id))
    ax.invert_yaxis()
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    handles += [
        Line2D([], [], marker="x", color="#D55E00", linestyle="", mew=2),
        Line2D([], [], marker="|", color="#000", linestyle="", mew=2),
    ]
    ax.legend(handles, [*PHASE_COLORS, "preempted", "finished"], **LEGEND_OUTSIDE)
    ax.set(xlabel="step", title="Requests over time")
    return ax


def plot_throughput(trace: StepTrace, ax: Axes | None = None) -> Axes:
    """Tokens computed per second in each step (model + sampling time), and the mean."""
    ax = _axes(ax)
    records = [r for r in trace if r.duration_s > 0]
    steps = [r.step for r in records]
    rates = [r.num_tokens / r.duration_s for r in records]
    ax.bar(steps, rates, color=["#0072B2" if r.num_prefill_tokens else "#009E73" for r in records])
    total_time = sum(r.duration_s for r in records)
    if total_time:
        mean = sum(r.num_tokens for r in records) / total_time
        ax.axhline(mean, color="#000", linestyle=":", label=f"overall {mean:,.0f} tok/s")
        ax.legend(**LEGEND_OUTSIDE)
    ax.set(xlabel="step (blue: has prefill, green: decode only)", ylabel="tokens / s", title="Throughput")
    return ax


class PlotView(TraceView):
    """A plot of the whole trace with a vertical cursor at the step on display, in the light and the
    dark rendering of `show_figure` (the page's theme picks one).

    Put it in a `StepPlayer` to see where in the run the other views are; attached to a
    live engine it grows with every step (rendering its two PNGs costs ~0.2 s per step).
    """

    draws_whole_run = True

    def __init__(self, trace: StepTrace, plot: PlotFn = plot_kv_cache_usage, **kwargs: Any) -> None:
        self.plot = plot
        super().__init__(trace, **kwargs)

    def render(self, record: StepRecord) -> str:
        # A Figure without pyplot: nothing is registered globally, nothing extra is displayed.
        fig = Figure(figsize=(8, 2.8), layout="constrained", facecolor=FACECOLOR)
        ax = self.plot(self.trace, fig.add_subplot())
        ax.axvline(record.step, color="#D55E00", linewidth=1.5)
        title = f"{ax.get_title()}, cursor at step {record.step}"
        # Two renderings (light and dark theme), as show_figure draws them.
        return f'<div class="pkv-plot" data-step="{record.step}">{themed_figure_html(fig, alt=title)}</div>'

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", {self.plot.__name__})"
