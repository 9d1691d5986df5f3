"""StepTrace: what it records matches what the engine did, and it survives JSON unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.config import CUDAGraphMode
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.models.loader import PRESETS
from pagedkv.trace import StepTrace

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello world!", "abc", "a longer prompt here, chunked"]


def run(model: str = "tiny-hybrid", **engine: int | bool) -> StepTrace:
    llm = LLM(model, block_size=4, **{"num_kv_blocks": 24, "max_num_batched_tokens": 16, **engine})
    with StepTrace.attach(llm) as trace:
        llm.generate(PROMPTS, PARAMS)
    return trace


@pytest.fixture(scope="module")
def trace() -> StepTrace:
    return run()


def test_records_only_while_attached() -> None:
    llm = LLM("tiny", num_kv_blocks=16, block_size=4)
    trace = StepTrace.attach(llm)
    llm.generate("ab", SamplingParams(temperature=0, max_tokens=2))
    assert len(trace) == 2 and trace.is_live
    trace.detach()
    llm.generate("ab", SamplingParams(temperature=0, max_tokens=2))
    assert len(trace) == 2 and not trace.is_live
    assert trace.step_numbers() == [1, 2]


def test_requests_phases_and_tokens(trace: StepTrace) -> None:
    first = trace[0]
    # Budget 16: the 13-token prompt fits, the next gets the 3 tokens left (chunked prefill).
    assert [(r.req_id, r.phase, r.num_computed_tokens, r.num_new_tokens) for r in first.scheduled] == [
        ("0", "prefill", 0, 13),
        ("1", "prefill", 0, 3),
    ]
    assert first.num_prefill_tokens == 16 and first.num_decode_tokens == 0
    for record in trace:
        assert record.num_tokens <= trace.engine.max_num_batched_tokens
        phases = [r.phase for r in record.scheduled]
        assert phases == sorted(phases, key=lambda p: p != "decode"), "decodes come first"
        for r in record.scheduled:
            if r.phase == "decode":
                assert r.num_new_tokens == 1
    # A request continues where the previous step left it.
    seen: dict[str, int] = {}
    for record in trace:
        for r in record.scheduled:
            assert r.num_computed_tokens == seen.get(r.req_id, 0)
            seen[r.req_id] = r.num_computed_tokens + r.num_new_tokens
    assert sorted(rid for record in trace for rid in record.finished_req_ids) == ["0", "1", "2"]


def test_slot_mapping_follows_block_tables(trace: StepTrace) -> None:
    for record in trace:
        owners = record.token_req_ids()
        rows = {r.req_id: r.block_ids for r in record.requests}
        for group in trace.engine.kv_cache_groups:
            bs = group.spec.block_size
            expected = [
                rows[rid][group.group_id][pos // bs] * bs + pos % bs for rid, pos in zip(owners, record.positions)
            ]
            assert record.slot_mappings[group.group_id] == expected


def test_block_counts(trace: StepTrace) -> None:
    usable = trace.engine.num_blocks - 1
    for record in trace:
        for g in range(trace.engine.num_kv_cache_groups):
            assert 0 < record.num_blocks_in_use[g] <= usable
            assert 0 <= record.num_free_blocks[g] <= usable
    assert trace[-1].num_free_blocks == [usable] * trace.engine.num_kv_cache_groups  # all finished


def test_attention_groups_and_shared_metadata(trace: StepTrace) -> None:
    engine = trace.engine
    assert engine.num_kv_cache_groups == 2  # sliding-window layers + full-attention layers
    assert len({a.backend for a in engine.attention_groups}) == 1  # TORCH_REF on the CPU, a kernel on a GPU
    assert sorted(n for a in engine.attention_groups for n in a.layer_names) == sorted(engine.layer_names)
    resolved = CUDAGraphMode[engine.cudagraph_mode]
    assert engine.device != "cpu" or resolved is CUDAGraphMode.NONE
    allowed = {resolved.decode_mode().name, resolved.mixed_mode().name, "NONE"}
    for record in trace:
        assert sorted(record.attn_metadata_keys) == sorted(engine.layer_names)
        assert sorted(record.slot_mapping_keys) == sorted(engine.layer_names)
        assert len(record.metadata) == len(engine.attention_groups)  # one build per attention group
        for group in engine.attention_groups:
            assert len({record.metadata_index(n) for n in group.layer_names}) == 1
        # A step runs one of the resolved mode's routines, or eagerly (above the largest capture size);
        # the CPU resolves every mode to NONE. A replayed graph's descriptor counts the padded tokens.
        assert record.cudagraph_mode in allowed
        padded = record.batch_descriptor["num_tokens"]
        assert padded == record.num_tokens if record.cudagraph_mode == "NONE" else padded >= record.num_tokens


def test_preemption_is_recorded() -> None:
    # Without prefix caching: a resumed request finds nothing cached and is recomputed from token 0
    # (with it, see test_trace_prefix_caching.py).
    trace = run("tiny", num_kv_blocks=11, max_num_batched_tokens=32, enable_prefix_caching=False)
    preempting = [r for r in trace if r.preempted_req_ids]
    assert preempting, "10 usable blocks of 4 tokens cannot hold all three requests at once"
    victim = preempting[0].preempted_req_ids[0]
    assert victim not in [r.req_id for r in preempting[0].requests]
    later = next(r for rec in trace if rec.step > preempting[0].step for r in rec.scheduled if r.req_id == victim)
    assert later.phase == "prefill" and later.num_computed_tokens == 0  # recomputed from scratch


def test_json_round_trip(trace: StepTrace, tmp_path: Path) -> None:
    loaded = StepTrace.load(trace.save(tmp_path / "trace.json"))
    assert loaded.engine == trace.engine
    assert loaded.steps == trace.steps
    assert not loaded.is_live
    assert repr(loaded) == repr(trace)
    with pytest.raises(ValueError, match="Not a pagedkv-trace"):
        StepTrace.from_json('{"format": "something else"}')


def test_long_prompts_drop_window_blocks() -> None:
    """Prompts past tiny-hybrid's 32-token window: the window group drops blocks (null block 0 in
    its table rows) that the full group keeps. The recorded input ids are the prompts' tokens, and
    the blocks in use (never counting block 0) are what each pool has given out."""
    prompts = [[(5 * i + j) % 200 + 3 for j in range(40)] for i in range(2)]
    llm = LLM("tiny-hybrid", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)
    with StepTrace.attach(llm) as trace:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4))
    window = next(g.group_id for g in trace.engine.kv_cache_groups if g.spec.sliding_window)
    rows = [r.block_ids for record in trace for r in record.requests]
    assert any(0 in row[window] and 0 not in row[1 - window] for row in rows)
    usable = trace.engine.num_blocks - 1
    for record in trace:
        for rid, pos, token in zip(record.token_req_ids(), record.positions, record.input_ids, strict=True):
            if pos < len(prompts[int(rid)]):
                assert token == prompts[int(rid)][pos]
        if not record.finished_req_ids:  # every allocated block belongs to a recorded request
            assert [usable - free for free in record.num_free_blocks] == record.num_blocks_in_use


def test_engine_info_describes_each_layers_cache(trace: StepTrace) -> None:
    """EngineInfo against tiny-hybrid's own config: sliding layers (0, 2) form the window group,
    full layers (1, 3) the other, and every layer's cache is [K and V, blocks, block size, KV heads,
    head size] as the engine was built (block_size=4, num_kv_blocks=24)."""
    config = PRESETS["tiny-hybrid"]
    head_size = config.hidden_size // config.num_attention_heads
    by_window = {g.spec.sliding_window: g for g in trace.engine.kv_cache_groups}
    assert set(by_window) == {config.sliding_window, None}
    for window, kind in ((config.sliding_window, "sliding_attention"), (None, "full_attention")):
        layers = [i for i, t in enumerate(config.layer_types) if t == kind]
        assert by_window[window].layer_names == [f"model.layers.{i}.self_attn.attn" for i in layers]
        assert (by_window[window].spec.num_kv_heads, by_window[window].spec.head_size) == (
            config.num_key_value_heads,
            head_size,
        )
    assert trace.engine.kv_cache_shapes == {
        name: [2, 24, 4, config.num_key_value_heads, head_size] for name in trace.engine.layer_names
    }
    assert len(trace.engine.layer_names) == config.num_hidden_layers


def test_a_running_request_left_out_of_a_step_is_recorded_unscheduled() -> None:
    """This scheduler gives every running request tokens (admission uses leftover budget only); a
    student's scheduler may not. Here one step leaves the newest decode out: the trace shows it as
    "unscheduled" with its blocks still held, it resumes where it stopped, and no token changes."""
    prompts = ["hello world!", "abc"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM("tiny", block_size=4, num_kv_blocks=24).generate(prompts, params)]

    llm = LLM("tiny", block_size=4, num_kv_blocks=24)
    schedule = llm.scheduler.schedule
    left_out: list[str] = []

    def schedule_leaving_one_out() -> SchedulerOutput:
        out = schedule()
        decodes = [s for s in out.scheduled if s.is_decode]
        if not left_out and len(decodes) == 2:
            left_out.append(decodes[-1].request.request_id)
            out.scheduled.remove(decodes[-1])
        return out

    llm.scheduler.schedule = schedule_leaving_one_out
    with StepTrace.attach(llm) as trace:
        outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert left_out, "both requests decoded in one step at some point"
    step = next(record for record in trace if any(r.phase == "unscheduled" for r in record.requests))
    (idle,) = [r for r in step.requests if r.phase == "unscheduled"]
    assert idle.req_id == left_out[0] and idle.num_new_tokens == 0
    assert idle.req_id not in [r.req_id for r in step.scheduled]
    after = next(r for record in trace if record.step > step.step for r in record.scheduled if r.req_id == idle.req_id)
    assert after.num_computed_tokens == idle.num_computed_tokens  # resumed exactly where it stopped
    assert after.block_ids == idle.block_ids  # its blocks were held, not freed
    held = {b for r in step.requests for b in r.block_ids[0]}
    assert step.num_blocks_in_use == [len(held)] and set(idle.block_ids[0]) <= held
