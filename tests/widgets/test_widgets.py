"""Widget state in plain Python: what each view holds after a step, live and replayed."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import jupyterlab
import matplotlib
import pytest

matplotlib.use("Agg")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.trace import StepTrace  # noqa: E402
from pagedkv.widgets import (  # noqa: E402
    AttentionGroupsView,
    BlockTableView,
    ForwardContextView,
    PlotView,
    SlotMappingView,
    StepPlayer,
    plot_batch_composition,
    plot_kv_cache_usage,
    plot_request_timeline,
    plot_throughput,
)
from pagedkv.widgets.common import PALETTE  # noqa: E402
from pagedkv.widgets.plots import FACECOLOR  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = ["hello world!", "abc", "a longer prompt"]
VIEWS = (BlockTableView, SlotMappingView, AttentionGroupsView, ForwardContextView)


def engine(model: str = "tiny") -> LLM:
    return LLM(model, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)


def count_blocks(html: str) -> int:
    return len(re.findall(r'class="pkv-block"', html))


@pytest.fixture(scope="module")
def hybrid_trace() -> StepTrace:
    llm = engine("tiny-hybrid")
    with StepTrace.attach(llm) as trace:
        llm.generate(PROMPTS, PARAMS)
    return trace


def test_live_view_follows_every_step() -> None:
    llm = engine()
    view = BlockTableView.attach(llm)
    assert "waiting for the first step" in view.value
    seen: list[str] = []
    view.trace.observe(lambda record: seen.append(view.value))  # after the view's own redraw
    llm.generate(PROMPTS, PARAMS)
    assert len(seen) == len(view.trace) > 1
    for record, html in zip(view.trace, seen):
        assert f'data-step="{record.step}"' in html
        assert count_blocks(html) == 20
    assert repr(view) == f"BlockTableView(step {view.trace[-1].step}, {len(view.trace)} recorded)"


@pytest.fixture
def notebook_shell(monkeypatch: pytest.MonkeyPatch) -> type:
    """What widgets use of a kernel's IPython shell (its events), in place of a running kernel:
    `notebook_shell.events.trigger("post_run_cell", None)` ends the 'cell'."""
    from IPython.core.events import EventManager, available_events

    from pagedkv.widgets import common

    class Shell:
        events = EventManager(None, available_events)

    monkeypatch.setattr(common, "_ipython", lambda: Shell)
    return Shell


def test_live_view_in_a_notebook_redraws_at_most_every_interval_and_at_the_cell_end(
    monkeypatch: pytest.MonkeyPatch,
    notebook_shell: type,
) -> None:
    from pagedkv.widgets import common

    Shell = notebook_shell
    monkeypatch.setattr(common, "LIVE_REDRAW_INTERVAL_S", 3600.0)
    llm = engine()
    view = BlockTableView.attach(llm, min_frame_s=0)  # nothing drawn live yet: the first step draws
    llm.generate(PROMPTS, PARAMS)
    assert len(view.trace) > 2
    assert 'data-step="1"' in view.value  # every later step came within the interval
    Shell.events.trigger("post_run_cell", None)  # the cell ends
    assert f'data-step="{view.trace[-1].step}"' in view.value
    assert not Shell.events.callbacks["post_run_cell"]  # the catch-up is gone again


class FakeClock:
    """`time` for LiveRedraw: monotonic() reads a clock that advances only by sleep() (and by
    `step_s` per reading, the time a step takes)."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.now, self.step_s, self.sleeps = 100.0, step_s, []

    def monotonic(self) -> float:
        self.now += self.step_s
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_live_view_in_a_notebook_shows_every_step_for_min_frame_s(
    monkeypatch: pytest.MonkeyPatch,
    notebook_shell: type,
) -> None:
    """Issue 32: "watch the view while generate runs" showed steps 1 -> 9 -> 20 in 0.5 s. With a
    minimum frame time every step is drawn and stays on screen at least that long."""
    from pagedkv.widgets import common

    clock = FakeClock()
    monkeypatch.setattr(common, "time", clock)
    llm = engine()
    view = BlockTableView.attach(llm, min_frame_s=0.25)
    frames: list[tuple[float, str]] = []
    view.observe(lambda change: frames.append((clock.now, change["new"])), "value")
    llm.generate(PROMPTS, PARAMS)
    steps = [int(re.search(r'data-step="(\d+)"', html).group(1)) for _t, html in frames]
    assert steps == view.trace.step_numbers()  # every step, in order, none skipped
    shown_for = [b[0] - a[0] for a, b in zip(frames, frames[1:])]
    assert min(shown_for) >= 0.25 and clock.sleeps  # the engine waited for each frame
    assert not notebook_shell.events.callbacks["post_run_cell"]  # nothing left to catch up


def test_min_frame_s_default_and_outside_a_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.widgets import common

    llm = engine()
    view = BlockTableView.attach(llm)
    assert view._live.min_frame_s == common.MIN_FRAME_S
    assert StepPlayer(view.trace)._live.min_frame_s == common.MIN_FRAME_S
    clock = FakeClock()
    monkeypatch.setattr(common, "time", clock)
    paced = BlockTableView(view.trace, min_frame_s=5.0)
    llm.generate(PROMPTS, PARAMS)  # a plain Python process: nobody watches, no waiting
    assert not clock.sleeps and f'data-step="{view.trace[-1].step}"' in paced.value
    with pytest.raises(ValueError, match="min_frame_s"):
        BlockTableView(view.trace, min_frame_s=-1)


def test_views_fit_their_output_area(hybrid_trace: StepTrace) -> None:
    """No view wider than its output area: the shrink rule rides along with every view's HTML."""
    from pagedkv.widgets.common import BASE_STYLE, FIT_CSS

    assert "max-width: 100%" in BASE_STYLE and "980px" not in BASE_STYLE
    for cls in VIEWS:
        view = cls(hybrid_trace)
        assert "pkv-view" in view._dom_classes and view.value.endswith(FIT_CSS)
    assert SlotMappingView(hybrid_trace).tokens_per_page == 20


def test_block_table_view_content(hybrid_trace: StepTrace) -> None:
    view = BlockTableView(hybrid_trace, index=0)
    html = view.value
    assert count_blocks(html) == 2 * 20  # one grid per KV cache group
    assert html.count('data-state="null"') == 2
    first = hybrid_trace[0]
    for r in first.requests:
        for block in r.block_ids[0]:
            assert f'data-block-id="{block}" data-group="0" data-state="used" data-owner="{r.req_id}"' in html
    assert html.count('data-state="free"') == 2 * first.num_free_blocks[0]
    small = BlockTableView(hybrid_trace, index=0, max_blocks=8)
    assert count_blocks(small.value) == 2 * 8 and "not drawn (12 more)" in small.value


def test_slot_mapping_view(hybrid_trace: StepTrace) -> None:
    record = hybrid_trace[1]
    html = SlotMappingView(hybrid_trace, index=1).value
    shown = [int(s) for s in re.findall(r'class="pkv-slot" data-slot="(-?\d+)"', html)]
    assert shown == record.slot_mappings[0] + record.slot_mappings[1]  # one row of slots per KV cache group


def test_attention_groups_view(hybrid_trace: StepTrace) -> None:
    empty = StepTrace(hybrid_trace.engine)
    before = AttentionGroupsView(empty).value  # start-up facts need no step
    assert before.count('class="pkv-attn-group"') == 2 and "pkv-metadata" not in before
    after = AttentionGroupsView(hybrid_trace).value
    assert after.count('class="pkv-metadata"') == 2
    assert after.count('class="pkv-layer"') == 4


def test_forward_context_view(hybrid_trace: StepTrace) -> None:
    html = ForwardContextView(hybrid_trace, index=0).value
    assert html.count('class="pkv-fc-row"') == 4
    assert "cudagraph_runtime_mode=NONE" in html
    assert "(shared with 1 more)" in html


def test_replay_draws_exactly_what_live_drew(hybrid_trace: StepTrace) -> None:
    replayed = StepTrace.from_json(hybrid_trace.to_json())
    for cls in VIEWS:
        for i in range(len(hybrid_trace)):
            assert cls(replayed, index=i).value == cls(hybrid_trace, index=i).value


def test_step_player_drives_views(hybrid_trace: StepTrace) -> None:
    views = [cls(hybrid_trace) for cls in VIEWS]
    player = StepPlayer(hybrid_trace, views)
    assert player.slider.max == len(hybrid_trace) - 1
    assert all(v.index == 0 for v in views)
    before = views[0].value
    player.slider.value = 2
    assert all(v.index == 2 for v in views)
    assert views[0].value != before and f'data-step="{hybrid_trace[2].step}"' in views[0].value
    assert repr(player) == (
        f"StepPlayer({len(hybrid_trace)} steps, at index 2, "
        "views=[BlockTableView, SlotMappingView, AttentionGroupsView, ForwardContextView])"
    )


def test_step_player_follows_a_live_trace() -> None:
    llm = engine()
    trace = StepTrace.attach(llm)
    view = BlockTableView(trace)
    player = StepPlayer(trace, [view])
    llm.generate(PROMPTS, PARAMS)
    assert player.slider.max == player.index == len(trace) - 1
    assert f'data-step="{trace[-1].step}"' in view.value


@pytest.mark.parametrize("plot", [plot_kv_cache_usage, plot_batch_composition, plot_request_timeline, plot_throughput])
def test_plots(hybrid_trace: StepTrace, plot) -> None:  # noqa: ANN001
    ax = plot(hybrid_trace)
    assert ax.get_title() and (ax.lines or ax.patches)
    ax.figure.canvas.draw()
    legend, axes_box = ax.get_legend(), ax.get_window_extent()
    assert legend.get_window_extent().x0 >= axes_box.x1, "the legend covers the data"
    html = PlotView(hybrid_trace, plot, index=1).value
    assert html.startswith('<div class="pkv-plot" data-step="2"><div class="pkv-figure">')
    assert html.count('src="data:image/png;base64,') == 2  # the light and the dark rendering


# ---- paging, the player's label, ForwardContextView in a player -----------------------------


@pytest.fixture(scope="module")
def long_prefill_trace() -> StepTrace:
    """One 25-token prompt (BOS + 24 bytes) prefilled in one step, then decodes."""
    llm = LLM("tiny", num_kv_blocks=20, block_size=4, max_num_batched_tokens=32)
    with StepTrace.attach(llm) as trace:
        llm.generate(["a prompt of twenty-three"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    return trace


def test_slot_mapping_pages_through_every_token(long_prefill_trace: StepTrace) -> None:
    prefill = long_prefill_trace[0]
    assert len(prefill.slot_mappings[0]) == 25
    view = SlotMappingView(long_prefill_trace, index=0, tokens_per_page=10)
    assert view.pager.max == 3  # pages of 10, 10 and 5 tokens
    seen: list[int] = []
    for page in (1, 2, 3):
        view.pager.value = page
        assert f'data-first-token="{10 * (page - 1)}"' in view.value
        seen += [int(s) for s in re.findall(r'class="pkv-slot" data-slot="(-?\d+)"', view.value)]
    assert seen == prefill.slot_mappings[0]  # every token once, in order: nothing left undrawn
    view.index = 1  # a decode step has one token: the page is clamped back to the first
    assert view.pager.max == view.pager.value == 1
    assert 'data-first-token="0"' in view.value and "tokens 0..0 of 1 (page 1 of 1)" in view.value
    with pytest.raises(ValueError, match="tokens_per_page"):
        SlotMappingView(long_prefill_trace, tokens_per_page=0)


def test_step_player_places_a_views_controls(long_prefill_trace: StepTrace) -> None:
    view = SlotMappingView(long_prefill_trace, tokens_per_page=10)
    player = StepPlayer(long_prefill_trace, [view])
    assert player.children[1:] == (view.pager, view)


def label_step(player: StepPlayer) -> int:
    return int(re.search(r'class="pkv-step-label" data-step="(\d+)"', player.label.value).group(1))


def test_step_player_shows_label_and_views_together(hybrid_trace: StepTrace, monkeypatch) -> None:  # noqa: ANN001
    """The browser gets each widget's new value in the order the kernel sets them: a render
    between two updates is time during which the page shows two different steps."""
    events: list[str] = []
    for cls in (BlockTableView, SlotMappingView, PlotView):
        render = cls.render
        monkeypatch.setattr(cls, "render", lambda self, record, _r=render: events.append("render") or _r(self, record))
    views = [BlockTableView(hybrid_trace), SlotMappingView(hybrid_trace), PlotView(hybrid_trace)]
    player = StepPlayer(hybrid_trace, views)
    for widget in (*views, player.label):
        widget.observe(lambda _change: events.append("set"), "value")
    for index in (3, 1, len(hybrid_trace) - 1):
        events.clear()
        player.slider.value = index
        assert events == ["render"] * 3 + ["set"] * 4, events
        step = hybrid_trace[index].step
        assert label_step(player) == step
        assert all(f'data-step="{step}"' in v.value for v in views)


def test_forward_context_view_in_a_step_player(hybrid_trace: StepTrace) -> None:
    view = ForwardContextView(hybrid_trace)
    player = StepPlayer(hybrid_trace, [view])
    for index in range(len(hybrid_trace)):
        player.slider.value = index
        record = hybrid_trace[index]
        assert f'data-step="{record.step}"' in view.value and label_step(player) == record.step
        # the metadata objects listed are this step's, not the last step's
        assert view.value.count("<li>") == len(record.metadata)
        for meta in record.metadata:
            fields = ", ".join(f"{f}={v}" for f, v in meta.fields.items())
            assert fields in unescape(view.value)


# ---- bad input, traces attached mid-run, players left behind ---------------------------------


def test_view_index_out_of_range_is_refused_and_the_view_keeps_its_step(hybrid_trace: StepTrace) -> None:
    view = BlockTableView(hybrid_trace, index=0)
    n = len(hybrid_trace)
    with pytest.raises(IndexError, match=rf"index {n} is out of range for a trace of {n} steps: use 0..{n - 1}"):
        view.index = n
    assert view.index == 0 and repr(view).startswith("BlockTableView(step 1,")
    with pytest.raises(IndexError, match=r"index 1 is out of range for a trace of 0 steps: use 0..0, or -1"):
        BlockTableView(StepTrace(hybrid_trace.engine), index=1)
    for bad in ({"max_blocks": -3}, {"columns": 0}):
        with pytest.raises(ValueError, match=rf"{next(iter(bad))} must be an int >= 1 \(.+\), got"):
            BlockTableView(hybrid_trace, **bad)
    with pytest.raises(TypeError, match=r"columns must be an int \(blocks per row of the grid\), got"):
        BlockTableView(hybrid_trace, columns=2.5)


def test_step_player_index_reads_minus_one_as_the_newest_step(hybrid_trace: StepTrace) -> None:
    player = StepPlayer(hybrid_trace, [BlockTableView(hybrid_trace)])
    player.index = -1
    assert player.index == len(hybrid_trace) - 1 and label_step(player) == hybrid_trace[-1].step
    with pytest.raises(IndexError, match="index 99 is out of range"):
        player.index = 99
    other = StepTrace.from_json(hybrid_trace.to_json())
    with pytest.raises(ValueError, match="BlockTableView draws another trace than the player's"):
        StepPlayer(hybrid_trace, [BlockTableView(other)])


def test_timeline_of_a_trace_attached_mid_run_shows_a_request_only_preempted() -> None:
    llm = LLM("tiny", num_kv_blocks=8, block_size=4, max_num_batched_tokens=32)
    for prompt in ["hello world!!", "abcdefghij", "a longer prompt"]:
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.step()
    llm.step()
    with StepTrace.attach(llm) as trace:  # attached mid-run (a later cell): its one step preempts request 1
        llm.step()
    assert trace[0].preempted_req_ids == ["1"] and "1" not in [r.req_id for r in trace[0].requests]
    assert "1" in trace.req_ids()
    ax = plot_request_timeline(trace)
    assert "req 1" in [label.get_text() for label in ax.get_yticklabels()]


def test_a_player_left_on_an_earlier_step_draws_nothing_per_step_in_a_notebook(
    monkeypatch: pytest.MonkeyPatch,
    notebook_shell: type,
) -> None:
    """Re-running a player's cell leaves the old player alive (ipywidgets keeps it): while a cell
    runs it must not draw its views for each new step; its plot of the whole run catches up when
    the cell ends. close() stops it following the trace at all."""
    Shell = notebook_shell
    llm = engine()
    trace = StepTrace.attach(llm)
    llm.generate(PROMPTS[:1], PARAMS)
    renders: list[str] = []
    for cls in (BlockTableView, PlotView):
        render = cls.render
        monkeypatch.setattr(
            cls, "render", lambda self, record, _r=render: renders.append(type(self).__name__) or _r(self, record)
        )
    plot = PlotView(trace)
    player = StepPlayer(trace, [BlockTableView(trace), plot])
    player.index = 0  # scrubbed back
    before = len(trace)
    renders.clear()
    llm.generate(PROMPTS, PARAMS)
    assert renders == [] and f"of {len(trace)})" in player.label.value  # only the label's count moved
    Shell.events.trigger("post_run_cell", None)
    assert renders == ["PlotView"] and player.index == 0 and len(trace) > before
    player.close()
    plot.close()
    renders.clear()
    label = player.label.value
    llm.generate(PROMPTS[:1], PARAMS)
    Shell.events.trigger("post_run_cell", None)
    assert renders == [] and player.label.value == label  # closed: not even the count moves


# ---- theme: colours come from JupyterLab's variables ----------------------------------------

HEX = re.compile(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b")
NAMED = re.compile(r"(?:[:=]\s*\"?)(white|black|gr[ae]y|silver)\b", re.IGNORECASE)


@pytest.mark.parametrize("cls", VIEWS)
def test_views_use_theme_colours(hybrid_trace: StepTrace, cls) -> None:  # noqa: ANN001
    for index in range(len(hybrid_trace)):
        html = cls(hybrid_trace, index=index).value
        assert set(HEX.findall(html)) <= set(PALETTE), f"{cls.__name__}: fixed colours {set(HEX.findall(html))}"
        assert not NAMED.findall(html), f"{cls.__name__}: named colours {NAMED.findall(html)}"
        assert "var(--jp-ui-font-color1" in html
        # SVG text is black unless told otherwise: every <svg> hands its text the theme's colour.
        assert html.count("<svg") == html.count("fill: currentColor")


def test_empty_view_uses_theme_colours(hybrid_trace: StepTrace) -> None:
    html = BlockTableView(StepTrace(hybrid_trace.engine)).value
    assert "waiting for the first step" in html and not HEX.findall(html) and "var(--jp-ui-font-color2" in html


def _theme_background(theme: str) -> str:
    """--jp-layout-color1 of a JupyterLab theme, read from the theme's shipped CSS."""
    css = (Path(jupyterlab.__file__).parent / "themes" / "@jupyterlab" / theme / "index.css").read_text()
    value = re.search(r"--jp-layout-color1:\s*([^;]+);", css).group(1)
    return {"white": "#ffffff"}.get(value, value.split(",")[-1].rstrip(")"))  # var(--md-grey-900,#212121)


def _luminance(color: str) -> float:
    channels = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["theme-light-extension", "theme-dark-extension"])
def test_request_colours_stand_out_on_both_theme_backgrounds(theme: str) -> None:
    background = _theme_background(theme)
    assert re.fullmatch(r"#[0-9a-fA-F]{6}", background), background
    worst = min(PALETTE, key=lambda c: _contrast(c, background))
    assert _contrast(worst, background) >= 3.0, f"{worst} on {background} ({theme})"


def test_plots_bring_their_own_background(hybrid_trace: StepTrace) -> None:
    # Jupyter's inline backend makes figures transparent: black labels on a dark page.
    with matplotlib.rc_context({"figure.facecolor": (1, 1, 1, 0)}):
        ax = plot_kv_cache_usage(hybrid_trace)
    assert matplotlib.colors.to_hex(ax.figure.get_facecolor(), keep_alpha=True) == FACECOLOR + "ff"
