"""Speculative decoding in the engine (issue 34, points 1-3 and 5): against the engine without it.

Greedy speculative output must equal the non-speculative engine's (float32 on the CPU) whatever the
drafts: proposed by prompt lookup, by a draft model, or forced by the test to be rejected at a chosen
position, accepted in full, or absent; with chunked prefill, preemption and prefix caching. Rejected
drafts are rolled back: a request holds the blocks of its known tokens only, and no block holding a
rejected token is ever cached.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.events import StepEvent
from pagedkv.kv_cache.block_pool import hash_request_blocks
from tests.engine.test_engine_api import assert_idle

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts that repeat phrases (prompt lookup finds drafts) and one that does not.
PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(n)] * reps}
    for i, (n, reps) in enumerate([(5, 4), (9, 3), (13, 1), (4, 6), (21, 2)])
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 30, "max_num_seqs": 4}
"""Chunked prompts (a budget of 16) and preemptions (30 blocks of 4 for 5 requests of up to 62 tokens)."""


def tokens(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return tokens(LLM("tiny", enable_prefix_caching=False).generate(PROMPTS, GREEDY))


def record_steps(llm: LLM) -> list[dict[str, Any]]:
    """Per step and request with drafts: what the step verified and what booking left behind."""
    steps: list[dict[str, Any]] = []

    def listen(event: StepEvent) -> None:
        for s in event.scheduler_output.scheduled:
            if s.draft_token_ids:
                request = s.request
                steps.append(
                    {
                        "drafts": list(s.draft_token_ids),
                        "accepted": s.num_accepted_tokens,
                        "rolled_back": s.rolled_back_block_ids,
                        "computed": request.num_computed_tokens,
                        "num_tokens": request.num_tokens,
                        "blocks": llm.kv_cache_manager.get_block_ids(request.request_id),
                        "finished": request.finish_reason is not None,
                    }
                )

    llm.add_step_listener(listen)
    return steps


@pytest.mark.parametrize(
    ("config", "engine"),
    [
        (NGRAM, {}),
        (NGRAM, SMALL),
        ({**NGRAM, "num_speculative_tokens": 1}, {"enable_prefix_caching": False, **SMALL}),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}, SMALL),
        ({"method": "draft_model", "model": "tiny-mla", "num_speculative_tokens": K}, SMALL),
    ],
    ids=["ngram", "ngram-chunked-preempted", "ngram-k1", "draft-same-weights", "draft-mla"],
)
def test_greedy_output_equals_the_engine_without_speculation(
    config: dict[str, Any], engine: dict[str, Any], expected: list[list[int]]
) -> None:
    llm = LLM("tiny", speculative_config=config, **engine)
    steps = record_steps(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    stats = llm.stats
    assert stats.num_draft_tokens == sum(len(s["drafts"]) for s in steps) > 0
    assert stats.num_accepted_tokens == sum(s["accepted"] for s in steps)
    assert stats.num_verified_steps == len(steps)
    if engine is SMALL and config is NGRAM:
        assert stats.num_preemptions > 0, "the small cache preempts"
    if config.get("model") == "tiny":  # the draft is the target: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    for s in steps:  # rejected drafts rolled back: only the known tokens stay computed
        if not s["finished"]:
            assert s["computed"] == s["num_tokens"] - 1
            # No block beyond the known tokens' (the target's new token gets its slot next step).
            assert all(len(row) <= -(-s["num_tokens"] // llm.runner.block_size) for row in s["blocks"])
    assert_idle(llm)


def test_draft_model_gets_its_own_kv_cache_group_and_attention_group() -> None:
    llm = LLM("tiny", speculative_config={"method": "draft_model", "model": "tiny-mla", "num_speculative_tokens": 2})
    groups = llm.runner.kv_cache_config.kv_cache_groups
    assert [name.startswith("draft.") for g in groups for name in g.layer_names[:1]] == [False, True]
    draft_group = [g for gs in llm.runner.attn_groups for g in gs if g.layer_names[0].startswith("draft.model.")]
    assert len(draft_group) == 1 and draft_group[0].layer_names == [
        f"draft.model.layers.{i}.self_attn.attn" for i in range(3)
    ]


class ForcedDrafts:
    """Drafts made from the expected output, wrong from position `wrong` on (K: all right)."""

    def __init__(self, expected: dict[str, list[int]], wrong: int) -> None:
        self.expected, self.wrong = expected, wrong

    def __call__(self, request: Any) -> list[int]:
        done = len(request.output_token_ids)
        right = self.expected[request.request_id][done : done + K]
        return [t if j < self.wrong else (t + 1) % 320 for j, t in enumerate(right)]


@pytest.mark.parametrize("wrong", range(K + 1))
def test_drafts_rejected_at_each_position_are_rolled_back(wrong: int, expected: list[list[int]]) -> None:
    llm = LLM("tiny", speculative_config=NGRAM, **SMALL)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    forced = ForcedDrafts(dict(zip(ids, expected)), wrong)
    llm._propose = forced  # type: ignore[method-assign]
    steps = record_steps(llm)
    final = {}
    while llm.has_unfinished_requests():
        final.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    assert [final[i] for i in ids] == expected
    full = [s for s in steps if len(s["drafts"]) == K]
    assert full and all(s["accepted"] == wrong for s in full)
    if wrong == 0:  # a block taken for drafts only goes back at booking
        assert any(any(row) for s in steps for row in s["rolled_back"])
    assert_idle(llm)


def test_no_block_holding_a_rejected_draft_is_ever_cached() -> None:
    llm = LLM(
        "tiny",
        block_size=4,
        speculative_config={"method": "draft_model", "model": "tiny-mla", "num_speculative_tokens": 4},
    )
    cached: set[Any] = set()

    def listen(event: StepEvent) -> None:  # every hash ever cached must be one of a real token prefix
        for pool in llm.kv_cache_manager.block_pools:
            cached.update(b.block_hash for b in pool.blocks if b.block_hash is not None)

    llm.add_step_listener(listen)
    outputs = llm.generate(PROMPTS, GREEDY)
    known = set()
    for out in outputs:
        known.update(hash_request_blocks(out.prompt_token_ids + out.outputs[0].token_ids, llm.runner.block_size, []))
    assert llm.stats.num_draft_tokens > llm.stats.num_accepted_tokens  # there were rejections
    assert cached and cached <= known


def test_seeded_sampling_is_reproducible_and_no_draft_means_plain_decoding() -> None:
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    runs = [tokens(LLM("tiny", speculative_config=NGRAM).generate(PROMPTS, seeded)) for _ in range(2)]
    assert runs[0] == runs[1]
    lone = [{"prompt_token_ids": list(range(3, 40))}]  # no repeated token: prompt lookup proposes nothing
    llm = LLM("tiny", speculative_config={**NGRAM, "prompt_lookup_min": 3})
    assert tokens(llm.generate(lone, SamplingParams(temperature=0, max_tokens=4))) == tokens(
        LLM("tiny").generate(lone, SamplingParams(temperature=0, max_tokens=4))
    )
    assert llm.stats.num_draft_tokens == 0


def test_streaming_and_abort_with_drafts(expected: list[list[int]]) -> None:
    llm = LLM("tiny", speculative_config=NGRAM)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    seen: dict[str, list[int]] = {}
    grew_by_more_than_one = False
    for _ in range(6):
        for out in llm.step():
            new = out.outputs[0].token_ids
            grew_by_more_than_one |= len(new) - len(seen.get(out.request_id, [])) > 1
            seen[out.request_id] = new
    assert grew_by_more_than_one
    assert all(expected[ids.index(r)][: len(t)] == t for r, t in seen.items())
    for request_id in ids:
        llm.abort_request(request_id)
    assert_idle(llm)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "must be one of"),
        ({"method": "ngram"}, ValueError, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, ValueError, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs 'model'"),
        ({"method": "draft_model", "model": "tiny-pydoc", "num_speculative_tokens": 2}, ValueError, "vocabulary"),
        ("ngram", TypeError, "must be a dict"),
    ],
)
def test_bad_speculative_configs_are_refused(config: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LLM("tiny", speculative_config=config)


def test_async_scheduling_is_off_with_speculation() -> None:
    assert LLM("tiny", speculative_config=NGRAM).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling=True cannot run with speculative_config"):
        LLM("tiny", speculative_config=NGRAM, async_scheduling=True)


def test_cli_takes_a_json_speculative_config() -> None:
    run = [
        sys.executable,
        "-m",
        "pagedkv",
        "generate",
        "--model",
        "tiny",
        "--max-tokens",
        "4",
        "--prompt-token-ids",
        "5,6,7,5,6,7,5",
    ]
    ok = subprocess.run(run + ["--speculative-config", json.dumps(NGRAM)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(run + ["--speculative-config", "{ngram"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--speculative-config" in bad.stderr and "Traceback" not in bad.stderr
