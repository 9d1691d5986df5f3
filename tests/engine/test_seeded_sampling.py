"""A seeded request's tokens through `LLM`: the same whatever happens around it (issue 44).

The sampler draws a request's token at position n from a uniform hashed from (its seed, n)
(pagedkv/worker/sampling_metadata.py), so the tokens may depend on nothing but the prompt, the
parameters and the seed: not the batch, the token budget's chunking, a preemption and the recompute
after it, async scheduling, an interrupted and rerun step, or speculative decoding's drafts (kept iff
they equal the token drawn at their position). Each test compares against the request run alone in a
fresh engine (CPU, float32, TORCH_REF). Unseeded requests draw from seeds derived from the engine seed
and their arrival number: two identical ones in a batch differ, and a run repeats in a fresh engine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pagedkv import LLM, SamplingParams
from tests.conftest import step_through_interrupts

# Prompts that repeat phrases (prompt lookup finds drafts) and one that does not.
PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(n)] * reps}
    for i, (n, reps) in enumerate([(5, 4), (9, 3), (13, 1), (4, 6)])
]
SEEDED = [
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=1.1, min_p=0.02, seed=12, max_tokens=14, ignore_eos=True),  # whole vocabulary
    SamplingParams(temperature=0.7, top_p=0.8, seed=2**64 - 5, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=-3, max_tokens=14, ignore_eos=True),
]
"""Request i's parameters: top-k + top-p, min-p, top-p, temperature only; seeds of every range."""
OTHERS = [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=7, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.5, seed=99, max_tokens=5, ignore_eos=True),
]
"""Other requests to batch them with (other parameters, lengths, seeds)."""
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "tiny-mla", "num_speculative_tokens": 2}


def engine(**kwargs: Any) -> LLM:
    return LLM("tiny", device="cpu", **{"attention_backend": "TORCH_REF", "block_size": 4, **kwargs})


def tokens(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each seeded request's tokens, run alone (one engine, one request at a time)."""
    llm = engine(async_scheduling=False)
    seeded = [tokens(llm.generate([prompt], params))[0] for prompt, params in zip(PROMPTS, SEEDED)]
    # Really sampled: a sampler that took the argmax would pass every invariance below.
    greedy = [replace(p, temperature=0.0) for p in SEEDED]
    assert seeded != tokens(llm.generate(PROMPTS, greedy)), "the seeded requests drew their greedy tokens"
    return seeded


def test_in_a_batch_with_other_requests(alone: list[list[int]]) -> None:
    """Interleaved with requests of other parameters (greedy among them), and in another order."""
    prompts = [p for i, p in enumerate(PROMPTS) for p in (p, PROMPTS[(i + 1) % 4])]
    params = [p for i, p in enumerate(SEEDED) for p in (p, OTHERS[i % 3])]
    assert tokens(engine().generate(prompts, params))[0::2] == alone
    assert tokens(engine().generate(PROMPTS[::-1], SEEDED[::-1]))[::-1] == alone


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 8},  # prompts in chunks of up to 8 tokens, beside decodes
        {"max_num_batched_tokens": 13, "max_num_seqs": 2},
        {"num_kv_blocks": 12},  # preempted and recomputed
    ],
    ids=["chunked-8", "chunked-13", "preempted"],
)
def test_chunked_or_preempted(config: dict[str, Any], alone: list[list[int]]) -> None:
    llm = engine(**config)
    prompts = PROMPTS + [PROMPTS[0]]
    assert tokens(llm.generate(prompts, SEEDED + [OTHERS[1]]))[:4] == alone
    if "num_kv_blocks" in config:
        assert llm.stats.num_preemptions > 0, "the small cache preempts"


def test_under_async_scheduling(alone: list[list[int]]) -> None:
    llm = engine(async_scheduling=True, num_kv_blocks=14)
    assert llm.async_scheduling
    assert tokens(llm.generate(PROMPTS + [PROMPTS[1]], SEEDED + [OTHERS[0]]))[:4] == alone
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_after_an_interrupted_step(where: str, alone: list[list[int]]) -> None:
    """A KeyboardInterrupt in the third step's forward or draw; step() called again goes on."""
    llm = engine(async_scheduling=False)
    owner, name = (llm.runner, "execute_model") if where == "model" else (llm.sampler, "draw")
    real, calls = getattr(owner, name), []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(owner, name, interrupted)
    ids = [llm.add_request(p, s) for p, s in zip(PROMPTS, SEEDED)]
    final, interrupts = step_through_interrupts(llm)
    assert interrupts == 1 and [final[i] for i in ids] == alone


@pytest.mark.parametrize(
    ("spec", "config"),
    [
        (NGRAM, {}),
        (NGRAM, {"max_num_batched_tokens": 9, "num_kv_blocks": 16}),  # fewer drafts, chunks, preemption
        (DRAFT, {"attention_backend": None}),  # the platform's choice per layer (TORCH_REF serves no MLA)
        ({**DRAFT, "model": "tiny", "num_speculative_tokens": 3}, {"max_num_batched_tokens": 10}),
    ],
    ids=["ngram", "ngram-small", "draft-mla", "draft-same-weights-small"],
)
def test_with_speculative_decoding(spec: dict[str, Any], config: dict[str, Any], alone: list[list[int]]) -> None:
    """The same tokens as without drafts, however many drafts the budget let each step have; two
    identical requests in one batch (so with drafts cut differently by the budget) identical too."""
    llm = engine(speculative_config=spec, **config)
    prompts = PROMPTS + PROMPTS[:2]
    out = tokens(llm.generate(prompts, SEEDED + SEEDED[:2]))
    assert out[:4] == alone
    assert out[4:] == alone[:2]
    assert llm.stats.num_draft_tokens > llm.stats.num_accepted_tokens, "drafts were rejected"
    # Kept ones too, except tiny-mla's: its random weights have nothing to do with tiny's.
    assert llm.stats.num_accepted_tokens > 0 or spec is DRAFT


def test_two_identical_unseeded_requests_differ_and_an_engine_run_repeats() -> None:
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = tokens(engine().generate([PROMPTS[2]] * 2, unseeded))
    assert first[0] != first[1]
    assert tokens(engine().generate([PROMPTS[2]] * 2, unseeded)) == first
