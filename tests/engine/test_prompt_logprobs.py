"""`prompt_logprobs` against `transformers` on tiny-pydoc's weights: per prompt token after the first, its
log-probability given the tokens before it and those of the N most likely tokens there, complete
across chunked prefill, preemption and prefix caching (such a request reads no cached prefix)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import RequestOutput
from pagedkv.models.loader import TRAINED_PRESETS

transformers = pytest.importorskip("transformers")

PROMPTS = ["The for statement", "A class definition defines a class object", "Raise an exception"]
ATOL = 1e-4
"""The engine computes in float32, the reference in float64: logprobs of a few units agree to ~1e-6."""


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(TRAINED_PRESETS["tiny-pydoc"], dtype=torch.float64)
    return model.eval()


def make_llm(**kwargs: object) -> LLM:
    return LLM("tiny-pydoc", device="cpu", dtype=torch.float32, block_size=4, **kwargs)  # type: ignore[arg-type]


@torch.no_grad()
def check(hf: torch.nn.Module, out: RequestOutput, n: int) -> None:
    """Entry i (i >= 1): the prompt token i and the reference's n most likely tokens at position i - 1."""
    ids = out.prompt_token_ids
    expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert entry is not None
        top = expected[i - 1].topk(n).indices.tolist() if n else []
        assert set(entry) == {ids[i], *top}, i
        for token, logprob in entry.items():
            assert logprob == pytest.approx(expected[i - 1, token].item(), abs=ATOL), (i, token)


@pytest.mark.parametrize("n", [0, 5])
def test_chunked_prefill_matches_transformers(hf_model: torch.nn.Module, n: int) -> None:
    # A budget of 8 tokens: each prompt is computed in 3 to 6 chunks, mixed with the others' steps.
    llm = make_llm(max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, prompt_logprobs=n))
    for out in outs:
        check(hf_model, out, n)


def test_with_prefix_caching_the_whole_prompt_is_computed(hf_model: torch.nn.Module) -> None:
    llm = make_llm(enable_prefix_caching=True)
    llm.generate(PROMPTS[1], SamplingParams(max_tokens=2))  # its 10 full blocks are cached
    assert llm.stats.num_cached_tokens == 0
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    check(hf_model, out, 3)
    assert llm.stats.num_cached_tokens == 0 and llm.stats.num_lookup_tokens == len(out.prompt_token_ids)
    again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0]  # others still read the cache
    assert again.prompt_logprobs is None and llm.stats.num_cached_tokens == 40


def test_preempted_requests_recompute_without_appending_twice(hf_model: torch.nn.Module) -> None:
    # 18 blocks of 4 tokens for 3 requests growing to 34, 58 and 36 tokens (33 blocks): the newest are preempted and
    # computed again from their first token.
    llm = make_llm(num_kv_blocks=18, max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=2))
    assert llm.stats.num_preemptions > 0
    for out in outs:
        check(hf_model, out, 2)


def test_n_children_return_the_prompt_logprobs_once(hf_model: torch.nn.Module) -> None:
    out = make_llm().generate(PROMPTS[0], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2
    check(hf_model, out, 1)


def test_without_it_there_are_none() -> None:
    assert make_llm().generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
