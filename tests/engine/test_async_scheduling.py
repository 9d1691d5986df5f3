"""Async scheduling on the CPU: step N+1 is planned and launched before step N's tokens are read.

The tokens must be those of the same engine without it (every engine test also runs with it on:
.ci/test sets PAGEDKV_ASYNC_SCHEDULING=1 for a second pass), through preemption, prefix caching,
chunked prefill, stops a step late, aborts and sampling errors.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID

CPU = dict(device="cpu", attention_backend="TORCH_REF")


def prompts(lengths: list[int], shared: int = 0) -> list[dict[str, list[int]]]:
    """Prompts of the given lengths; the first `shared` tokens of each are the same (a cached prefix)."""
    return [
        {"prompt_token_ids": [(j if j < shared else 7 * i + 3 * j) % 250 + 1 for j in range(n)]}
        for i, n in enumerate(lengths)
    ]


def run(async_scheduling: bool, prompt_list, params, **engine) -> tuple[LLM, list[list[int]], list[str]]:
    llm = LLM("tiny", async_scheduling=async_scheduling, **CPU, **engine)
    outs = llm.generate(prompt_list, params)
    return llm, [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs]


def mixed_params(n: int, max_tokens: int = 12, stop: list[int] | None = None) -> list[SamplingParams]:
    """Greedy and seeded requests, alternating; `stop` may end the first two early (a data-dependent stop)."""
    return [
        SamplingParams(
            temperature=0 if i % 2 else 0.8,
            seed=None if i % 2 else 100 + i,
            max_tokens=max_tokens,
            stop_token_ids=(stop or []) if i < 2 else [],
            ignore_eos=True,
        )
        for i in range(n)
    ]


SCENARIOS = {
    # 4 requests in 9 blocks of 4 tokens: preempted and recomputed, some while their token is in flight.
    "preemption": (prompts([9, 14, 6, 11]), dict(num_kv_blocks=9, block_size=4)),
    # A 60-token prompt in chunks of a 24-token budget beside decodes.
    "chunked_prefill": (prompts([5, 60, 3]), dict(num_kv_blocks=64, max_num_batched_tokens=24)),
    # Shared 32-token prefixes: later requests hit blocks the earlier ones' steps wrote.
    "prefix_caching": (prompts([40, 37, 45, 33], shared=32), dict(num_kv_blocks=64, block_size=8, max_num_seqs=2)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_async_gives_the_tokens_of_sync(scenario: str) -> None:
    prompt_list, engine = SCENARIOS[scenario]
    _, want, _ = run(False, prompt_list, mixed_params(len(prompt_list)), **engine)
    # A stop token some requests meet on the way: they stop a step later under async scheduling.
    stop = [want[0][4], want[1][2]]
    params = mixed_params(len(prompt_list), stop=stop)
    _, want, want_reasons = run(False, prompt_list, params, **engine)
    llm, got, reasons = run(True, prompt_list, params, **engine)
    assert got == want and reasons == want_reasons
    assert "stop" in reasons and "length" in reasons
    if scenario == "preemption":
        assert llm.stats.num_preemptions > 0
    if scenario == "prefix_caching":
        assert llm.stats.num_cached_tokens > 0
    # Every block is back (the dropped decodes of stopped requests included), none is lost.
    pool = llm.kv_cache_manager.block_pools[0]
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert not llm.has_unfinished_requests() and not llm._requests


def launches(llm: LLM) -> list:
    """Record each step's ScheduledTokens and input ids as the runner gets them."""
    seen = []
    execute = llm.runner.execute_model

    def recording(scheduled, previous=None, freed_req_ids=()):
        result = execute(scheduled, previous, freed_req_ids)
        seen.append((scheduled, result.batch.input_ids.clone()))
        return result

    llm.runner.execute_model = recording
    return seen


def test_the_next_step_is_launched_before_the_tokens_are_read_and_reads_them_on_the_device() -> None:
    llm = LLM("tiny", async_scheduling=True, **CPU)
    seen = launches(llm)
    for p in prompts([5, 7]):
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = llm.step()
    assert len(seen) == 2  # the prefill, and the decode planned before its tokens were read
    scheduled, input_ids = seen[1]
    assert all(s.token_ids == [PLACEHOLDER_TOKEN_ID] for s in scheduled)
    # The runner filled the placeholders from the device: they are the tokens step 1 returned.
    assert input_ids[: len(scheduled)].tolist() == [o.outputs[0].token_ids[-1] for o in first]
    second = llm.step()
    assert [o.outputs[0].token_ids[:1] for o in second] == [o.outputs[0].token_ids for o in first]
    assert len(seen) == 3


def test_a_request_that_reaches_max_tokens_is_not_planned_again() -> None:
    llm = LLM("tiny", async_scheduling=True, **CPU)
    seen = launches(llm)
    llm.generate(prompts([5]), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(seen) == 3  # prefill + 2 decodes: its length ends it, known before its last token is read


def test_abort_while_a_step_is_in_flight() -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = LLM("tiny", async_scheduling=False, **CPU).generate(prompts([6])[:1], params)[0].outputs[0].token_ids
    llm = LLM("tiny", async_scheduling=True, num_kv_blocks=32, **CPU)
    keep, drop = (llm.add_request(p, params) for p in prompts([6, 9]))
    llm.step()
    llm.step()
    assert llm.abort_request(drop)  # its next step is launched already
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    assert {o.request_id for o in outs} == {keep} and outs[-1].outputs[0].token_ids == alone
    pool = llm.kv_cache_manager.block_pools[0]
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_failed_sample_ends_that_request_alone() -> None:
    llm = LLM("tiny", async_scheduling=True, **CPU)
    compute_logits = llm.model.compute_logits

    def nan_for_the_second(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        if logits.shape[0] == 2:
            logits[1] = float("nan")
        return logits

    llm.model.compute_logits = nan_for_the_second
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts([5, 8]), params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"]
    assert "NaN" in outs[1].error and len(outs[0].outputs[0].token_ids) == 5
