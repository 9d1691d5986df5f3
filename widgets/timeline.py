"""A profiled engine on a timeline: a host lane and a device lane, and where a step's time goes.

    from pagedkv.trace.profile import profile_decode
    from pagedkv.widgets import plot_step_breakdown, show_figure, timeline_figure

    off = profile_decode(llm, async_scheduling=False)
    on = profile_decode(llm, async_scheduling=True)
    show_figure(timeline_figure([off, on], ["async scheduling off", "async scheduling on"]))
    show_figure(plot_step_breakdown([off, on], ["off", "on"]))

The host lane holds the engine's phase ranges (pagedkv/ranges.py), the device lane the kernels (on
a CPU: the aten operators), each coloured by the phase that launched it, so a kernel can be traced
back to the host range that put it on the GPU. Under async scheduling the host plans and launches
step N+1 (schedule .. sample) before it waits for step N's tokens (wait, book): on a GPU the
device lane then has no gap between steps. Each figure keeps its own opaque light background;
`show_figure` adds the dark rendering.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pagedkv.ranges import PHASES
from pagedkv.trace.profile import StepProfile
from pagedkv.widgets.plots import FACECOLOR, LEGEND_OUTSIDE

PHASE_COLORS = {
    "schedule": "#E69F00",
    "prepare": "#56B4E9",
    "forward": "#009E73",
    "sample": "#D55E00",
    "wait": "#999999",
    "book": "#CC79A7",
}
"""One colour per phase (Okabe-Ito, told apart with colour blindness); wait is grey: the host idles."""
UNKNOWN_COLOR = "#555555"
"""Device work launched outside the engine's ranges (before the profiled window, say)."""
HOST_Y, DEVICE_Y, LANE_HEIGHT = 1.0, 0.0, 0.6


def _window(profile: StepProfile, calls: int | None) -> tuple[float, float]:
    """(start, end) of the last `calls` profiled `LLM.step()` calls (all of them for None)."""
    shown = profile.calls if calls is None else profile.calls[-calls:]
    return shown[0][0], shown[-1][1]


def plot_step_timeline(
    profile: StepProfile, ax: Axes | None = None, *, calls: int | None = 3, title: str | None = None
) -> Axes:
    """The host lane and the device lane of the last `calls` `LLM.step()` calls, in ms from the first
    of them; thin vertical lines where a call starts; each step's number over its device work."""
    if ax is None:
        _fig, ax = plt.subplots(figsize=(9, 2.4), layout="constrained", facecolor=FACECOLOR)
    t0, t1 = _window(profile, calls)

    def ms(t: float) -> float:
        return (t - t0) / 1000

    host = [h for h in profile.host if h.end > t0 and h.start < t1]
    ax.broken_barh(
        [(ms(h.start), (h.end - h.start) / 1000) for h in host],
        (HOST_Y - LANE_HEIGHT / 2, LANE_HEIGHT),
        facecolors=[PHASE_COLORS[h.phase] for h in host],
    )
    device = [d for d in profile.device if d.end > t0 and d.start < t1]
    ax.broken_barh(
        [(ms(d.start), max((d.end - d.start) / 1000, 1e-4)) for d in device],
        (DEVICE_Y - LANE_HEIGHT / 2, LANE_HEIGHT),
        facecolors=[PHASE_COLORS.get(d.phase or "", UNKNOWN_COLOR) for d in device],
    )
    spans: dict[int, list[float]] = {}
    for d in device:
        if d.step is not None:
            span = spans.setdefault(d.step, [d.start, d.end])
            span[0], span[1] = min(span[0], d.start), max(span[1], d.end)
    for step, (start, end) in spans.items():
        middle = (max(start, t0) + min(end, t1)) / 2
        ax.text(ms(middle), DEVICE_Y + LANE_HEIGHT / 2 + 0.05, f"step {step}", ha="center", va="bottom", fontsize=9)
    for start, _ in profile.calls:
        if t0 <= start <= t1:
            ax.axvline(ms(start), color="#888888", linewidth=0.8, linestyle=":")
    device_label = "GPU" if profile.device_kind == "cuda" else "CPU ops"
    ax.set_yticks([DEVICE_Y, HOST_Y], [device_label, "host"])
    ax.set_ylim(-0.5, 1.55)
    ax.set_xlim(0, ms(t1))
    ax.set_xlabel("ms (dotted: an LLM.step() call starts)")
    ax.set_title(title or f"{profile.model} on {profile.device_name}, batch {profile.batch}")
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in PHASES]
    if any(d.phase is None for d in device):  # e.g. the sampled tokens' copy, started between two ranges
        handles.append(Patch(color=UNKNOWN_COLOR, label="no range"))
    ax.legend(handles=handles, title="phase", **LEGEND_OUTSIDE)
    return ax


def timeline_figure(profiles: Sequence[StepProfile], titles: Sequence[str], *, calls: int | None = 3) -> Figure:
    """`plot_step_timeline` of each profile, one above the other on one time scale (e.g. async
    scheduling off and on: the same number of calls takes less time with it on a GPU)."""
    if len(profiles) != len(titles):
        raise ValueError(f"One title per profile: {len(profiles)} profiles, {len(titles)} titles.")
    fig, axes = plt.subplots(
        len(profiles),
        1,
        figsize=(9, 2.3 * len(profiles)),
        layout="constrained",
        facecolor=FACECOLOR,
        sharex=True,
        squeeze=False,
    )
    for ax, profile, title in zip(axes[:, 0], profiles, titles):
        plot_step_timeline(profile, ax, calls=calls, title=title)
        ax.label_outer()
        if ax is not axes[0, 0]:  # one legend: the phases are the same in every row
            ax.get_legend().remove()
    longest = max(_window(p, calls)[1] - _window(p, calls)[0] for p in profiles) / 1000
    axes[0, 0].set_xlim(0, longest)
    return fig


def plot_step_breakdown(profiles: Sequence[StepProfile], labels: Sequence[str], ax: Axes | None = None) -> Axes:
    """Where one step's time goes, per profile: the host's phases (and time in none of them) in one
    bar, the device busy and idle in another, both as long as a step (us, from each summary)."""
    if len(profiles) != len(labels):
        raise ValueError(f"One label per profile: {len(profiles)} profiles, {len(labels)} labels.")
    if ax is None:
        _fig, ax = plt.subplots(figsize=(9, 0.9 + 0.9 * len(profiles)), layout="constrained", facecolor=FACECOLOR)
    rows: list[str] = []
    for i, (profile, label) in enumerate(zip(profiles, labels)):
        s = profile.summary
        host_y, device_y = 2 * i, 2 * i + 1  # host above device (the y axis is inverted)
        left = 0.0
        for phase in PHASES:
            width = s.host_us[phase]
            ax.barh(host_y, width, left=left, color=PHASE_COLORS[phase], height=0.7)
            left += width
        ax.barh(host_y, s.host_other_us, left=left, color="#dddddd", height=0.7)
        ax.barh(device_y, s.device_busy_us, color="#0072B2", height=0.7)
        ax.barh(device_y, s.device_idle_us, left=s.device_busy_us, color="#dddddd", height=0.7, hatch="//")
        device = "GPU" if profile.device_kind == "cuda" else "CPU ops"
        rows += [f"{label}: host", f"{label}: {device}"]
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("us per decode step")
    ax.set_title("Where a decode step's time goes")
    ax.legend(
        handles=[
            *(Patch(color=PHASE_COLORS[p], label=p) for p in PHASES),
            Patch(color="#dddddd", label="host: no phase"),
            Patch(color="#0072B2", label="device busy"),
            Patch(facecolor="#dddddd", hatch="//", label="device idle"),
        ],
        **LEGEND_OUTSIDE,
    )
    return ax
