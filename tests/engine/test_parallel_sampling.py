"""`n` outputs of one prompt (vLLM V1's fan-out): each child is an ordinary request, seeded seed + i, that
shares the prompt's KV cache blocks through prefix caching; callers see only the parent's id."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.engine.request import RequestOutput

PROMPT = "The for statement"  # 18 tokens with BOS: 4 full blocks of 4, and 2 tokens in a fifth


def make_llm(**kwargs: object) -> LLM:
    return LLM("tiny-pydoc", device="cpu", dtype=torch.float32, block_size=4, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def test_seeded_children_draw_as_separate_requests_seeded_seed_plus_i(llm: LLM) -> None:
    params = SamplingParams(n=3, seed=1234, max_tokens=10, temperature=1.0)
    out = llm.generate(PROMPT, params)[0]
    assert out.request_id and len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    alone = llm.generate([PROMPT] * 3, [SamplingParams(seed=1234 + i, max_tokens=10) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.outputs[0].text for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # the seeds differ, so do the draws


def test_unseeded_children_differ_and_the_largest_seed_wraps(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=10))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    top = 2**64 - 1  # seed + 1 wraps to 0 (a seed is used modulo 2**64)
    wrapped = llm.generate(PROMPT, SamplingParams(n=2, seed=top, max_tokens=10))[0]
    alone = llm.generate([PROMPT] * 2, [SamplingParams(seed=s, max_tokens=10) for s in (top, 0)])
    assert [c.token_ids for c in wrapped.outputs] == [a.outputs[0].token_ids for a in alone]


def blocks_of_first_step(llm: LLM, params: SamplingParams) -> tuple[list[RequestOutput], StepEvent]:
    events: list[StepEvent] = []
    detach = llm.add_step_listener(events.append)
    try:
        outputs = llm.generate(PROMPT, params)
    finally:
        detach()
    return outputs, events[0]


@pytest.mark.parametrize("backend", ["TORCH_REF", "TRITON_ATTN"])
def test_greedy_children_share_the_prompt_blocks_and_agree(llm: LLM, backend: str) -> None:
    engine = make_llm(attention_backend=backend, num_kv_blocks=32)  # given: no profile run
    # Few steps: Triton runs interpreted on a CPU.
    both, four = blocks_of_first_step(engine, SamplingParams(n=4, temperature=0, max_tokens=3))
    # All four admitted in the first step: children 1-3 hit the 4 full blocks child 0 fills in that very
    # step (hashed when planned), and take one block each for their last 2 prompt tokens.
    tables = [four.block_ids[s.request.request_id][0] for s in four.scheduler_output.scheduled]
    assert len(tables) == 4 and all(t[:4] == tables[0][:4] for t in tables)
    assert len({t[4] for t in tables}) == 4
    assert [s.num_cached_tokens for s in four.scheduler_output.scheduled] == [0, 16, 16, 16]
    used = engine.kv_cache_manager.num_usable_blocks - four.num_free_blocks[0]
    assert used == 5 + 3  # one request of 18 tokens holds 5 blocks; the other three 1 each
    # They read blocks written in the same forward: the tokens of one greedy request.
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert [c.token_ids for c in both[0].outputs] == [expected] * 4


def test_a_child_admitted_in_a_later_chunk_reads_the_blocks_written_in_that_step() -> None:
    # Budget 10: step 1 runs child 0's tokens 0-9; step 2 its tokens 10-17, filling blocks 2 and 3, and
    # admits child 1, which hits blocks 0-3 (2 and 3 being written in this step) and runs tokens 16-17.
    llm = make_llm(max_num_batched_tokens=10, max_num_seqs=2)
    out, _ = blocks_of_first_step(llm, SamplingParams(n=2, temperature=0, max_tokens=6))
    alone = make_llm().generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert [c.token_ids for c in out[0].outputs] == [alone, alone]
    assert llm.stats.num_cached_tokens == 16


def test_streaming_under_the_parent_id(llm: LLM) -> None:
    parent = llm.add_request(PROMPT, SamplingParams(n=3, seed=7, max_tokens=4), request_id="mine")
    other = llm.add_request(PROMPT, SamplingParams(max_tokens=2))
    assert parent == "mine" and other not in ("mine", "0_mine")
    with pytest.raises(ValueError, match="'mine' is in use"):
        llm.add_request(PROMPT, SamplingParams(), request_id="mine")
    with pytest.raises(ValueError, match="'1_mine' is in use"):  # a child's id
        llm.add_request(PROMPT, SamplingParams(), request_id="1_mine")
    with pytest.raises(TypeError, match="request_id must be a str"):
        llm.add_request(PROMPT, SamplingParams(), request_id=5)  # type: ignore[arg-type]
    assert llm.abort_request("0_mine") is False  # the engine's own ids are not the caller's
    seen: dict[int, list[int]] = {}
    finished = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == other:
                continue
            assert out.request_id == "mine" and len(out.outputs) == 1
            seen[out.outputs[0].index] = out.outputs[0].token_ids
            finished.append(out.finished)
    assert finished.count(True) == 1 and finished[-1]  # only the last output of the last child
    expected = llm.generate([PROMPT] * 3, [SamplingParams(seed=7 + i, max_tokens=4) for i in range(3)])
    assert [seen[i] for i in range(3)] == [e.outputs[0].token_ids for e in expected]


def test_abort_the_parent_aborts_every_child(llm: LLM) -> None:
    llm.add_request(PROMPT, SamplingParams(n=3, max_tokens=4), request_id="p")
    llm.step()
    assert llm.has_unfinished_requests()
    assert llm.abort_request("p") is True
    assert not llm.has_unfinished_requests() and llm.abort_request("p") is False
    llm.add_request(PROMPT, SamplingParams(n=2, max_tokens=1), request_id="p")  # the id is free again
    while llm.has_unfinished_requests():
        llm.step()
