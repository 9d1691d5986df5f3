"""StepTrace with prefix caching: each step's block pools (ref counts, short hashes, free queue)
match the engine's, each request's cache hits are recorded, and older traces still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.kv_cache.block_pool import BlockPool
from pagedkv.trace import SHORT_HASH_CHARS, StepTrace, block_pool_record
from tests.trace.test_trace import run

SYSTEM = list(range(1, 11))  # a 10-token "system prompt": two full blocks of 4, then 2 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def engine(**kwargs: int | bool) -> LLM:
    return LLM("tiny", device="cpu", block_size=4, **{"num_kv_blocks": 16, **kwargs})


def prompt(*suffix: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": SYSTEM + list(suffix)}


@pytest.fixture(scope="module")
def shared() -> tuple[StepTrace, LLM]:
    """Two requests sharing SYSTEM in one batch, then a third after both finished."""
    llm = engine()
    with StepTrace.attach(llm) as trace:
        llm.generate([prompt(50, 51), prompt(60)], PARAMS, use_tqdm=False)
        llm.generate([prompt(70, 71, 72)], PARAMS, use_tqdm=False)
    return trace, llm


def test_every_step_records_the_live_pool() -> None:
    llm = engine()
    checked: list[int] = []

    def compare(event: StepEvent) -> None:  # added after the trace: runs right after it recorded the step
        record = trace[-1]
        for pool, pool_record in zip(llm.kv_cache_manager.block_pools, record.block_pools, strict=True):
            assert pool_record.ref_cnts == [b.ref_cnt for b in pool.blocks]
            assert pool_record.free_queue_order() == list(pool.free_queue)
            for block, short in zip(pool.blocks, pool_record.block_hashes, strict=True):
                assert short == (None if block.block_hash is None else block.block_hash.hex()[:SHORT_HASH_CHARS])
        checked.append(event.step)

    trace = StepTrace.attach(llm)
    llm.add_step_listener(compare)
    llm.generate([prompt(50, 51), prompt(60), prompt(50, 51, 52, 53)], PARAMS, use_tqdm=False)
    assert checked == trace.step_numbers() and len(checked) > 1
    assert trace.engine.prefix_caching


def test_shared_blocks_and_hits_in_the_first_step(shared: tuple[StepTrace, LLM]) -> None:
    trace, _ = shared
    first = trace[0]
    a, b = first.requests
    # Request 0 computes all 12 tokens; request 1, admitted after it in the same step, finds
    # SYSTEM's two full blocks already cached (they are written in this very step, before any
    # layer attends) and computes only its last 3 tokens.
    assert (a.num_cached_tokens, a.num_computed_tokens, a.num_new_tokens) == (0, 0, 12)
    assert (b.num_cached_tokens, b.num_computed_tokens, b.num_new_tokens) == (8, 8, 3)
    assert first.num_cached_tokens == 8
    assert a.block_ids[0][:2] == b.block_ids[0][:2] and a.block_ids[0][2] != b.block_ids[0][2]
    pool = first.block_pools[0]
    assert [pool.ref_cnts[block] for block in a.block_ids[0][:2]] == [2, 2]
    assert all(pool.block_hashes[block] is not None for block in a.block_ids[0][:3])  # every full block
    assert len(pool.block_hashes[a.block_ids[0][0]]) == SHORT_HASH_CHARS


def test_finished_requests_leave_evictable_blocks(shared: tuple[StepTrace, LLM]) -> None:
    trace, llm = shared
    end_of_first = next(r for r in trace if r.finished_req_ids)
    pool = end_of_first.block_pools[0]
    assert pool.ref_cnts[1:] == [0] * (trace.engine.num_blocks - 1)  # both finished: every block free
    evictable = pool.evictable()
    assert len(evictable) == pool.num_cached_blocks > 2
    # Freed last block first: SYSTEM's first block is the last cached block in line for eviction.
    assert evictable[-1] == end_of_first.requests[0].block_ids[0][0]
    third = next(r for rec in trace for r in rec.scheduled if r.req_id == "2")
    assert third.num_cached_tokens == 8 and third.block_ids[0][:2] == end_of_first.requests[0].block_ids[0][:2]
    assert sum(r.num_cached_tokens for rec in trace for r in rec.requests) == llm.stats.num_cached_tokens == 16


def test_resume_from_the_cache_is_recorded() -> None:
    # As test_trace.test_preemption_is_recorded, with prefix caching on: the victim's full blocks
    # stay cached when it is preempted, so it resumes from them instead of from token 0.
    trace = run("tiny", num_kv_blocks=11, max_num_batched_tokens=32)
    preempting = next(r for r in trace if r.preempted_req_ids)
    victim = preempting.preempted_req_ids[0]
    resumed = next(r for rec in trace if rec.step > preempting.step for r in rec.scheduled if r.req_id == victim)
    assert resumed.phase == "prefill" and resumed.num_cached_tokens > 0
    assert resumed.num_computed_tokens == resumed.num_cached_tokens  # it starts right after the hit
    assert resumed.num_cached_tokens % trace.engine.block_size == 0


def test_without_caching_nothing_is_hashed() -> None:
    llm = engine(enable_prefix_caching=False)
    with StepTrace.attach(llm) as trace:
        llm.generate([prompt(50), prompt(60)], PARAMS, use_tqdm=False)
    assert not trace.engine.prefix_caching
    for record in trace:
        assert all(h is None for pool in record.block_pools for h in pool.block_hashes)
        assert record.num_cached_tokens == 0
        assert set(record.block_pools[0].ref_cnts[1:]) <= {0, 1}  # nothing shared


def test_free_queue_is_stored_as_runs() -> None:
    pool = BlockPool(10)
    assert block_pool_record(pool).free_queue == [[1, 9]]  # a fresh pool: one run
    taken = pool.get_new_blocks(4)  # blocks 1-4
    pool.free_blocks(taken[::-1])
    record = block_pool_record(pool)
    assert record.free_queue == [[5, 9], [4, 4], [3, 3], [2, 2], [1, 1]]
    assert record.free_queue_order() == [5, 6, 7, 8, 9, 4, 3, 2, 1] == list(pool.free_queue)


def test_json_round_trip_and_older_traces(shared: tuple[StepTrace, LLM], tmp_path: Path) -> None:
    trace, _ = shared
    loaded = StepTrace.load(trace.save(tmp_path / "trace.json"))
    assert loaded.steps == trace.steps and loaded.engine == trace.engine
    # A trace recorded before these fields: they take their defaults.
    payload = json.loads(trace.to_json())
    del payload["engine"]["prefix_caching"]
    for step in payload["steps"]:
        del step["block_pools"]
        for request in step["requests"]:
            del request["num_cached_tokens"]
    old = StepTrace.from_json(json.dumps(payload))
    assert not old.engine.prefix_caching
    assert all(r.block_pools == [] and r.num_cached_tokens == 0 for r in old)
    shipped = StepTrace.load(Path(__file__).parents[2] / "notebooks" / "traces" / "h200_tiny-hybrid.json")
    assert len(shipped) > 0 and shipped[0].block_pools == []
