"""SpecDecodeView: per request with drafts, the verdict of each draft, the emitted tokens and the KV slots written
then rolled back, checked against slots worked out by hand on a hand-built step; and on a real tiny engine run with
n-gram speculation, against the engine's own slot mapping."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagedkv import LLM, RequestOutput, SamplingParams
from pagedkv.trace import (
    AttentionGroupInfo,
    EngineInfo,
    KVCacheGroupInfo,
    KVSpecInfo,
    RequestRecord,
    StepRecord,
    StepTrace,
)
from pagedkv.widgets import SpecDecodeView
from pagedkv.widgets.common import PALETTE
from pagedkv.widgets.spec_decode import draft_slots
from tests.widgets.test_widgets import HEX, NAMED

BS = 4


def hand_trace() -> StepTrace:
    """One step, blocks of 4. Request 0: 6 tokens cached, its known token and 3 drafts at positions 6-9 (block
    table [3, 7, 9]: positions 6, 7 in block 7, positions 8, 9 in block 9), 1 draft accepted, so the two in block 9
    are rejected and block 9 is given back. Request 1: a plain decode at position 2 (block 2)."""
    spec = KVSpecInfo("FullAttentionSpec", BS, 1, 8, "float32")
    layer = "model.layers.0.self_attn.attn"
    engine = EngineInfo(
        model="hand",
        device="cpu",
        dtype="float32",
        block_size=BS,
        num_blocks=16,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        layer_names=[layer],
        kv_cache_groups=[KVCacheGroupInfo(0, [layer], spec)],
        attention_groups=[AttentionGroupInfo(0, "TORCH_REF", "TorchRefMetadataBuilder", [layer], spec, 2)],
        kv_cache_shapes={layer: [2, 16, BS, 1, 8]},
    )
    speculated = RequestRecord(
        "0",
        "decode",
        6,
        4,
        5,
        [[3, 7, 9]],
        draft_token_ids=[104, 105, 106],
        num_accepted_tokens=1,
        rolled_back_block_ids=[[9]],
        emitted_token_ids=[104, 33],
    )
    plain = RequestRecord("1", "decode", 2, 1, 2, [[2]])
    record = StepRecord(
        step=7,
        requests=[speculated, plain],
        input_ids=[103, 104, 105, 106, 50],
        positions=[6, 7, 8, 9, 2],
        slot_mappings=[[30, 31, 36, 37, 10]],
        num_blocks_in_use=[4],
        num_free_blocks=[11],
        preempted_req_ids=[],
        finished_req_ids=[],
        metadata=[],
        attn_metadata_keys=[],
        slot_mapping_keys=[],
        cudagraph_mode="NONE",
        batch_descriptor={"num_tokens": 5, "uniform_decode": False},
        duration_s=0.0,
    )
    return StepTrace(engine, [record])


def test_slots_by_hand() -> None:
    trace = hand_trace()
    record = trace[0]
    slots = draft_slots(record, record.requests[0], trace.engine)
    assert [(s.position, s.token_id, s.kind, s.slots) for s in slots] == [
        (6, 103, "known", [30]),
        (7, 104, "accepted", [31]),
        (8, 105, "rejected", [36]),
        (9, 106, "rejected", [37]),
    ]
    assert [s.blocks[0] for s in slots] == [(1, 7, 2), (1, 7, 3), (2, 9, 0), (2, 9, 1)]
    assert record.requests[0].num_rejected_tokens == 2 and record.requests[1].num_rejected_tokens == 0


def test_view_marks_verdicts_slots_and_the_block_given_back() -> None:
    view = SpecDecodeView(hand_trace(), decode=lambda ids: bytes(ids).decode())
    html = view.value
    assert "1 request(s) verified 3 draft(s)" in html and "1 accepted (33%)" in html and "2 token(s) emitted" in html
    assert re.findall(r'class="pkv-draft" data-kind="(\w+)"', html) == ["known", "accepted", "rejected", "rejected"]
    kept = re.findall(r'class="pkv-slot" data-kind="(\w+)" data-slots="(\d+)" title="([^"]+)"', html)
    assert kept == [
        ("known", "30", "written, kept"),
        ("accepted", "31", "written, kept"),
        ("rejected", "36", "written, rolled back"),
        ("rejected", "37", "written, rolled back"),
    ]
    assert html.count("✓ accepted") == 1 and html.count("✗ rejected") == 2  # glyphs, not colour alone
    assert re.search(r'data-block="9" title="[^"]*given back', html) and re.search(
        r'data-block="7" title="[^"]*written', html
    )
    assert "104 <b>h</b>" in html and "33 <b>!</b>" in html  # token text from `decode`
    assert "a correction: the target's token where draft 2 was rejected" in html
    assert "without drafts (query length as usual): 1 (no draft)" in html
    assert repr(view) == "SpecDecodeView(step 7, 1 recorded)"


def test_all_accepted_is_a_bonus_and_no_drafts_says_so() -> None:
    trace = hand_trace()
    r = trace[0].requests[0]
    r.num_accepted_tokens, r.rolled_back_block_ids, r.emitted_token_ids = 3, [[]], [104, 105, 106, 10]
    html = SpecDecodeView(trace).value
    assert "a bonus" in html and "✗" not in html.split("pkv-emitted")[0].split("</table>")[0]
    trace[0].requests[0] = RequestRecord("0", "decode", 6, 1, 5, [[3, 7]])
    assert "no request verified drafts in this step" in SpecDecodeView(trace).value


def test_theme_colours_and_width() -> None:
    html = SpecDecodeView(hand_trace()).value
    assert set(HEX.findall(html)) <= set(PALETTE) and not NAMED.findall(html)
    assert "var(--jp-ui-font-color1" in html and "max-width: 100%" in html


def test_old_traces_load_without_the_new_fields(tmp_path: Path) -> None:
    trace = hand_trace()
    loaded = StepTrace.load(trace.save(tmp_path / "spec.json"))
    assert loaded.steps == trace.steps
    payload = json.loads(trace.to_json())
    for request in payload["steps"][0]["requests"]:  # a trace recorded before these fields
        for field in ("draft_token_ids", "num_accepted_tokens", "rolled_back_block_ids", "emitted_token_ids"):
            del request[field]
    old = StepTrace.from_json(json.dumps(payload))
    r = old[0].requests[0]
    assert (r.draft_token_ids, r.num_accepted_tokens, r.rolled_back_block_ids, r.emitted_token_ids) == (
        [],
        None,
        [],
        [],
    )


@pytest.mark.parametrize(
    "saved",  # the step traces (prefill_ladder_*.json beside them are benchmark figures for notebook 15, profile_step_*.json step profiles for notebook 16)
    sorted(
        p
        for p in (Path(__file__).parents[2] / "notebooks" / "traces").glob("*.json")
        if not p.name.startswith(("prefill_ladder", "profile_step"))
    ),
)
def test_saved_notebook_traces_still_load(saved: Path) -> None:
    trace = StepTrace.load(saved)
    assert all(r.draft_token_ids == [] and r.num_accepted_tokens is None for s in trace for r in s.requests)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def ngram_run() -> tuple[StepTrace, list[RequestOutput], LLM]:
    """A real tiny-pydoc run with n-gram speculation, blocks of 4 (rollbacks cross block boundaries)."""
    llm = LLM("tiny-pydoc", device="cpu", block_size=4, num_kv_blocks=64, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with StepTrace.attach(llm) as trace:
        outputs = llm.generate(["The for statement is used to", "A list is"], params, use_tqdm=False)
    return trace, outputs, llm


def test_a_real_run_records_drafts_verdicts_and_emitted_tokens(ngram_run: tuple[StepTrace, list, LLM]) -> None:
    trace, outputs, llm = ngram_run
    speculated = [(record, r) for record in trace for r in record.scheduled if r.draft_token_ids]
    assert speculated and all(r.phase == "decode" and r.num_accepted_tokens is not None for _, r in speculated)
    assert sum(len(r.draft_token_ids) for _, r in speculated) == llm.stats.num_draft_tokens
    assert sum(r.num_accepted_tokens for _, r in speculated) == llm.stats.num_accepted_tokens
    for output in outputs:  # the first token comes from the prefill; each later step emits its record's tokens
        steps = [r for record in trace for r in record.scheduled if r.req_id == output.request_id][1:]
        emitted = [t for r in steps for t in (r.emitted_token_ids or [])]
        plain = sum(1 for r in steps if not r.draft_token_ids)  # decodes without a proposal: one token each
        assert len(emitted) + plain == len(output.outputs[0].token_ids) - 1
        assert all(
            r.emitted_token_ids[: r.num_accepted_tokens] == r.draft_token_ids[: r.num_accepted_tokens]
            for r in steps
            if r.draft_token_ids
        )


def test_a_real_runs_slots_and_rollbacks(ngram_run: tuple[StepTrace, list, LLM]) -> None:
    trace, _, _ = ngram_run
    rolled_back = 0
    for i, record in enumerate(trace):
        start = 0
        for r in record.scheduled:
            if r.draft_token_ids:
                slots = [s.slots[0] for s in draft_slots(record, r, trace.engine)]
                assert slots == record.slot_mappings[0][start : start + r.num_new_tokens]  # the engine's own
                for block in (r.rolled_back_block_ids or [[]])[0]:
                    rolled_back += 1
                    # It held only rejected positions, and the request's next row no longer has it.
                    assert all(
                        s.kind == "rejected" for s in draft_slots(record, r, trace.engine) if s.blocks[0][1] == block
                    )
                    later = [q for q in trace[i + 1].requests if q.req_id == r.req_id] if i + 1 < len(trace) else []
                    assert all(block not in q.block_ids[0] for q in later)
            start += r.num_new_tokens
    assert rolled_back > 0  # blocks of 4 and 3 drafts: some rollbacks give a block back


def test_a_real_run_drawn_live_and_replayed(ngram_run: tuple[StepTrace, list, LLM], tmp_path: Path) -> None:
    trace, _, llm = ngram_run
    index = next(i for i, record in enumerate(trace) if any(r.draft_token_ids for r in record.scheduled))
    live = SpecDecodeView(trace, index=index, decode=llm.tokenizer.decode).value
    replayed = SpecDecodeView(StepTrace.load(trace.save(tmp_path / "t.json")), index=index, decode=llm.tokenizer.decode)
    assert live == replayed.value and "verified" in live and 'class="pkv-draft" data-kind="known"' in live
    view = SpecDecodeView.attach(llm)
    assert view.decode == llm.tokenizer.decode and view.trace.is_live
    view.trace.detach()
    view.close()
