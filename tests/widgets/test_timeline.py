"""The profile timeline: a hand-made profile drawn as a host lane and a device lane whose bars sit where its
intervals are (ms from the first call shown) in the colour of their phase; the last `calls` calls only; one
time scale and one legend for two profiles; the breakdown's bars as long as the summary says."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from pagedkv.ranges import PHASES  # noqa: E402
from pagedkv.trace.profile import DeviceRange, HostRange, ProfileSummary, StepProfile  # noqa: E402
from pagedkv.widgets import plot_step_breakdown, plot_step_timeline, show_figure, timeline_figure  # noqa: E402
from pagedkv.widgets.timeline import PHASE_COLORS, UNKNOWN_COLOR  # noqa: E402


def _profile(device_kind: str = "cuda", step_us: float = 1000.0) -> StepProfile:
    """Two calls of 1 ms: call 1 plans step 7 and books step 6, call 2 plans step 8 and books step 7."""
    host = [
        HostRange("schedule", 7, 0, 100, 0),
        HostRange("forward", 7, 100, 400, 0),
        HostRange("book", 6, 500, 600, 0),
        HostRange("schedule", 8, 1000, 1100, 0),
        HostRange("forward", 8, 1100, 1300, 0),
        HostRange("book", 7, 1500, 1600, 0),
    ]
    device = [
        DeviceRange("old", None, None, -50, 50),
        DeviceRange("gemm", 7, "forward", 150, 900, 12),
        DeviceRange("gemm", 8, "forward", 1200, 1900, 12),
    ]
    summary = ProfileSummary(
        step_us, {**dict.fromkeys(PHASES, 0.0), "schedule": 100.0, "forward": 250.0, "book": 100.0}, 550.0, 700.0, 300.0
    )
    return StepProfile(device_kind, "H", "m", 4, True, [(0, 1000), (1000, 2000)], host, device, summary)


def _lanes(ax: plt.Axes) -> list[list[tuple[float, float, str]]]:
    """Per broken_barh collection: (x, width, colour) of each bar."""
    lanes = []
    for c in ax.collections:
        assert isinstance(c, PolyCollection)
        bars = []
        for path, color in zip(c.get_paths(), c.get_facecolors()):
            xs = path.vertices[:, 0]
            bars.append((round(float(xs.min()), 6), round(float(xs.max() - xs.min()), 6), to_hex(color)))
        lanes.append(bars)
    return lanes


def test_the_lanes_put_each_interval_where_it_ran_in_its_phase_colour() -> None:
    ax = plot_step_timeline(_profile(), calls=None)
    host, device = _lanes(ax)
    c = {p: PHASE_COLORS[p].lower() for p in PHASES}
    assert host == [
        (0.0, 0.1, c["schedule"]),
        (0.1, 0.3, c["forward"]),
        (0.5, 0.1, c["book"]),
        (1.0, 0.1, c["schedule"]),
        (1.1, 0.2, c["forward"]),
        (1.5, 0.1, c["book"]),
    ]
    assert device == [(-0.05, 0.1, UNKNOWN_COLOR), (0.15, 0.75, c["forward"]), (1.2, 0.7, c["forward"])]
    assert [t.get_text() for t in ax.texts] == ["step 7", "step 8"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["GPU", "host"]
    assert ax.get_xlim() == (0.0, 2.0)
    assert [line.get_xdata()[0] for line in ax.lines] == [0.0, 1.0]  # where each call starts
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [*PHASES, "no range"]
    plt.close(ax.figure)


def test_only_the_last_calls_are_drawn_from_zero() -> None:
    ax = plot_step_timeline(_profile("cpu"), calls=1)
    host, device = _lanes(ax)
    assert [x for x, _, _ in host] == [0.0, 0.1, 0.5]  # the second call's ranges, 1 ms earlier
    assert device == [(0.2, 0.7, PHASE_COLORS["forward"].lower())]  # step 7's work ended before the call
    assert ax.get_xlim() == (0.0, 1.0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CPU ops", "host"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(PHASES)  # no work outside a range
    plt.close(ax.figure)


def test_two_profiles_share_one_time_scale_and_one_legend() -> None:
    short, long = _profile(), _profile()
    long.calls = [(0, 1000), (1000, 3000)]
    fig = timeline_figure([short, long], ["off", "on"], calls=None)
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim() == (0.0, 3.0)
    assert top.get_legend() is not None and bottom.get_legend() is None
    assert [top.get_title(), bottom.get_title()] == ["off", "on"]
    with pytest.raises(ValueError, match="One title per profile"):
        timeline_figure([short], ["a", "b"])
    plt.close(fig)


def test_the_breakdown_bars_are_the_summary() -> None:
    ax = plot_step_breakdown([_profile()], ["async"])
    bars = [(round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_y() + p.get_height() / 2)) for p in ax.patches]
    host = [b for b in bars if b[2] == 0]
    device = [b for b in bars if b[2] == 1]
    # the host's phases one after another, then the time in none of them: together one step
    assert [w for _, w, _ in host] == [100.0, 0.0, 250.0, 0.0, 0.0, 100.0, 550.0]
    assert host[-1][0] + host[-1][1] == 1000.0
    assert device == [(0.0, 700.0, 1), (700.0, 300.0, 1)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["async: host", "async: GPU"]
    show_figure(ax)  # both renderings are made (dark recolouring included)
