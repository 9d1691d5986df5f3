"""Widget state in plain Python: what each view holds after a step, live and replayed."""

from __future__ import annotations

import re

import matplotlib
import pytest

matplotlib.use("Agg")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.trace import StepTrace  # noqa: E402
from widgets import (  # noqa: E402
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


@pytest.mark.parametrize(
    "plot", [plot_kv_cache_usage, plot_batch_composition, plot_request_timeline, plot_throughput]
)
def test_plots(hybrid_trace: StepTrace, plot) -> None:  # noqa: ANN001
    ax = plot(hybrid_trace)
    assert ax.get_title() and (ax.lines or ax.patches)
    html = PlotView(hybrid_trace, plot, index=1).value
    assert html.startswith('<img class="pkv-plot" data-step="2" src="data:image/png;base64,')
