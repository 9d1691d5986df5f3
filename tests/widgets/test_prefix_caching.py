"""BlockTableView with prefix caching: shared blocks show every owner and their ref count, free
blocks that still hold a cached prefix (evictable) are drawn apart from plain free ones, the head
of the free queue is marked, and the colours still come from the theme."""

from __future__ import annotations

import re

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.trace import StepRecord, StepTrace
from pagedkv.widgets import BlockTableView, StepPlayer
from pagedkv.widgets.common import PALETTE
from tests.widgets.test_widgets import HEX, NAMED

SYSTEM = list(range(1, 14))  # 13 tokens: three full blocks of 4
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def trace() -> StepTrace:
    """Three requests sharing SYSTEM, then (all finished) a fourth that takes the cached blocks back."""
    llm = LLM("tiny", device="cpu", block_size=4, num_kv_blocks=24)
    with StepTrace.attach(llm) as trace:
        llm.generate([{"prompt_token_ids": SYSTEM + [40 + i, 50 + i]} for i in range(3)], PARAMS, use_tqdm=False)
        llm.generate({"prompt_token_ids": SYSTEM + [90]}, PARAMS, use_tqdm=False)
    return trace


def cells(html: str, state: str) -> list[str]:
    """The <g> of every block cell in `state`."""
    return re.findall(rf'<g class="pkv-block"[^>]*data-state="{state}".*?</g>', html)


def block_id(cell: str) -> int:
    return int(re.search(r'data-block-id="(\d+)"', cell).group(1))


def owners_of(record: StepRecord) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for r in record.requests:
        for block in r.block_ids[0]:
            owners.setdefault(block, []).append(r.req_id)
    return owners


def test_a_shared_block_shows_every_owner_and_its_ref_count(trace: StepTrace) -> None:
    first = trace[0]
    html = BlockTableView(trace, index=0).value
    shared = {b: o for b, o in owners_of(first).items() if len(o) > 1}
    assert len(shared) == 3  # SYSTEM's three full blocks, in all three block tables
    drawn = cells(html, "shared")
    assert sorted(block_id(c) for c in drawn) == sorted(shared)
    for cell in drawn:
        owners = shared[block_id(cell)]
        assert f'data-owner="{",".join(owners)}"' in cell
        assert re.findall(r'class="pkv-owner" data-owner="(\w+)"', cell) == owners  # one colour bar each
        assert f">x{len(owners)}</text>" in cell
        assert len(owners) == first.block_pools[0].ref_cnts[block_id(cell)]
        assert f'data-hash="{first.block_pools[0].block_hashes[block_id(cell)]}"' in cell
    # Requests 1 and 2 found SYSTEM's blocks in the cache: their rows mark them as hits.
    assert html.count('class="pkv-row-cell pkv-hit"') == sum(r.num_cached_tokens // 4 for r in first.requests) == 6


def test_evictable_blocks_are_drawn_apart_from_free_ones(trace: StepTrace) -> None:
    index = next(i for i, r in enumerate(trace) if r.finished_req_ids) + 1  # the step after all three finished
    record = trace[index]
    pool = record.block_pools[0]
    held = owners_of(record)
    html = BlockTableView(trace, index=index).value
    evictable = {b for b in pool.evictable() if b not in held}
    cached = cells(html, "cached")
    assert evictable and sorted(block_id(c) for c in cached) == sorted(evictable)
    queue = pool.free_queue_order()
    for cell in cached:
        block = block_id(cell)
        assert f'data-hash="{pool.block_hashes[block]}"' in cell and f">{pool.block_hashes[block]}</text>" in cell
        assert "<line" in cell and "stroke-dasharray" not in cell  # hatched and outlined, not dashed
        assert f">#{queue.index(block) + 1}</text>" in cell or 'data-next="true"' in cell
    plain = cells(html, "free")
    assert all("stroke-dasharray" in c or 'data-next="true"' in c for c in plain)
    assert all(pool.block_hashes[block_id(c)] is None for c in plain)
    # The head of the free queue, the block the next allocation takes, is marked "next".
    nexts = re.findall(r'<g class="pkv-block"[^>]*data-next="true"', html)
    assert len(nexts) == 1 and f'data-block-id="{queue[0]}"' in nexts[0]
    line = re.search(r'class="pkv-free-queue">(.*?)</div>', html).group(1)
    assert all(pool.block_hashes[b] in line for b in evictable)


def test_the_fourth_request_takes_the_cached_blocks_back(trace: StepTrace) -> None:
    index, record = next((i, r) for i, r in enumerate(trace) if any(q.req_id == "3" for q in r.requests))
    request = next(q for q in record.requests if q.req_id == "3")
    assert request.num_cached_tokens == 12
    html = BlockTableView(trace, index=index).value
    assert "12 found by prefix caching" in html
    for block in request.block_ids[0][:3]:  # back in a block table: no longer evictable
        assert f'data-block-id="{block}" data-group="0" data-state="used" data-owner="3"' in html


def test_views_without_caching_or_from_older_traces_draw_no_cache_state(trace: StepTrace) -> None:
    llm = LLM("tiny", device="cpu", block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    with StepTrace.attach(llm) as plain:
        llm.generate([{"prompt_token_ids": SYSTEM + [40]}, {"prompt_token_ids": SYSTEM + [41]}], PARAMS, use_tqdm=False)
    for record in plain:
        html = BlockTableView(plain, index=plain.steps.index(record)).value
        assert not cells(html, "shared") and not cells(html, "cached")
        assert "pkv-free-queue" not in html and "prefix caching:" not in html
    old = StepTrace.from_json(trace.to_json())
    for record in old:
        record.block_pools = []
    html = BlockTableView(old, index=-1).value
    assert not cells(html, "cached") and 'data-next="true"' not in html


def test_theme_colours_and_replay(trace: StepTrace) -> None:
    replayed = StepTrace.from_json(trace.to_json())
    player = StepPlayer(trace, [BlockTableView(trace)])
    for index in range(len(trace)):
        player.index = index
        html = player.views[0].value
        assert set(HEX.findall(html)) <= set(PALETTE)
        assert not NAMED.findall(html)
        assert html.count("<svg") == html.count("fill: currentColor")
        assert html == BlockTableView(replayed, index=index).value


def test_cache_hits_have_a_border_of_their_own(trace: StepTrace) -> None:
    """Notebook 12: a block found in the cache was outlined in the accent blue, request 0's colour too."""
    from pagedkv.widgets.block_table import HIT_BORDER
    from pagedkv.widgets.common import ACCENT, FG

    html = BlockTableView(trace, index=0).value
    hits = re.findall(r'<span class="pkv-row-cell pkv-hit" title="[^"]*" style="([^"]*)"', html)
    assert len(hits) == 6 and all(f"border:{HIT_BORDER}" in style for style in hits)
    assert HIT_BORDER == f"3px double {FG}" and ACCENT not in HIT_BORDER
    assert not any(color in HIT_BORDER for color in PALETTE)  # no request's colour
    others = re.findall(r'<span class="pkv-row-cell" title="[^"]*" style="([^"]*)"', html)
    assert others and not any("double" in style for style in others)


def test_show_caching_overrides_the_engine_setting(trace: StepTrace) -> None:
    index = next(i for i, r in enumerate(trace) if r.finished_req_ids) + 1  # evictable blocks on display
    hidden = BlockTableView(trace, index=index, show_caching=False).value
    assert not cells(hidden, "cached") and "data-hash=" not in hidden
    assert "pkv-free-queue" not in hidden and "prefix caching:" not in hidden and "pkv-hit" not in hidden
    assert BlockTableView(trace, index=0, show_caching=False).value.count("pkv-hit") == 0
    llm = LLM("tiny", device="cpu", block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    with StepTrace.attach(llm) as plain:
        llm.generate([{"prompt_token_ids": SYSTEM + [40]}], PARAMS, use_tqdm=False)
    assert BlockTableView(plain).caching_shown is False
    asked = BlockTableView(plain, show_caching=True).value
    assert "pkv-free-queue" in asked and "prefix caching:" in asked  # asked for: drawn, with nothing cached
    with pytest.raises(TypeError, match="show_caching"):
        BlockTableView(plain, show_caching="yes")
