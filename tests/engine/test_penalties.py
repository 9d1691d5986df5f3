"""Presence, frequency and repetition penalties, logit_bias and min_tokens (pagedkv/engine/logits_processors.py),
each against an independent reference: transformers' RepetitionPenaltyLogitsProcessor, float64 torch
or hand-worked numbers; then through `LLM.generate` against the same model run by transformers in
float64 with the penalty applied step by step, with speculative decoding, a prefix-cache hit and (in
.ci/test's second run) async scheduling.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.engine.logits_processors import apply_logits_processors
from pagedkv.engine.sampler import Sampler, sampling_metadata
from pagedkv.models.hf_export import to_transformers

V = 40
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts that repeat phrases: the penalties have something to count, prompt lookup finds drafts.
PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(n)] * reps}
    for i, (n, reps) in enumerate([(5, 3), (4, 4)])
]


def processed(params: list[SamplingParams], histories: list[tuple[list[int], list[int]]], logits: torch.Tensor,
              positions: list[int] | None = None, eos: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """The engine's logits after its processors, each row drawing after its whole history (or at `positions`)."""
    if positions is None:
        positions = [len(prompt) + len(output) for prompt, output in histories]
    meta = sampling_metadata(params, [0] * len(params), positions, logits.shape[1], "cpu", histories, eos)
    return apply_logits_processors(logits, meta)


def test_repetition_penalty_is_transformers_repetition_penalty_logits_processor() -> None:
    """Prompt and output tokens alike, positive logits divided, negative multiplied: bit for bit."""
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, V) * 4
    histories = [([1, 2, 2, 30], [5, 1, 7]), ([9], []), ([3, 4], [39, 39, 0])]
    penalties = [1.3, 0.7, 2.0]
    out = processed([SamplingParams(repetition_penalty=r) for r in penalties], histories, logits)
    for i, ((prompt, output), r) in enumerate(zip(histories, penalties)):
        expected = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        torch.testing.assert_close(out[i], expected[0], rtol=0, atol=0)
    assert not torch.equal(out, logits)


def test_presence_and_frequency_count_output_tokens_only() -> None:
    """Hand-worked: prompt [1, 2, 2], output [2, 3, 3, 3]; presence 0.5, frequency 0.25: token 2 loses
    0.5 + 0.25, token 3 loses 0.5 + 3 * 0.25, token 1 (prompt only) nothing. Then a random batch
    against float64 counts."""
    logits = torch.zeros(1, 8)
    out = processed([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [([1, 2, 2], [2, 3, 3, 3])], logits)
    assert out[0].tolist() == [0, 0, -0.75, -1.25, 0, 0, 0, 0]
    torch.manual_seed(1)
    logits = torch.randn(4, V, dtype=torch.float64)
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in [(1.5, -0.3), (0, 2), (-2, 0), (0.1, 0.1)]
    ]
    histories = [([int(t) for t in torch.randint(V, (n,))], [int(t) for t in torch.randint(V, (m,))]) for n, m in
                 [(5, 9), (1, 30), (12, 3), (7, 0)]]  # fmt: skip
    out = processed(params, histories, logits.float())
    for i, (p, (_, output)) in enumerate(zip(params, histories)):
        expected = logits[i].clone()
        for token, count in Counter(output).items():
            expected[token] -= p.presence_penalty + p.frequency_penalty * count
        torch.testing.assert_close(out[i].double(), expected, rtol=0, atol=1e-5)


def test_a_row_counts_only_the_tokens_before_its_position() -> None:
    """Speculative decoding's rows of one request share its tokens: each counts those before the
    position it draws (its drafts up to there), not the drafts after it."""
    prompt, output = [1], [5, 5, 6, 5]  # the last three are drafts, rows draw at positions 2, 3, 4, 5
    logits = torch.zeros(4, V)
    out = processed([SamplingParams(frequency_penalty=1.0)] * 4, [(prompt, output)] * 4, logits, [2, 3, 4, 5])
    assert [(-out[r, 5].item(), -out[r, 6].item()) for r in range(4)] == [(1, 0), (2, 0), (2, 1), (3, 1)]


def test_logit_bias_moves_greedy_and_leaves_other_rows_bit_for_bit() -> None:
    """+100 on one id: greedy picks it; a mixed batch's rows without a bias (greedy and sampled) get
    the same tokens, logits and logprobs as in a batch where no row has one; logprobs stay raw."""
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    plain = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.9, seed=4, logprobs=2)]
    biased = SamplingParams(temperature=0, logit_bias={17: 100.0, 3: -5.0}, logprobs=2)
    batch = [plain[0], biased, plain[1]]
    histories = [([1], [])] * 3
    meta = sampling_metadata(batch, [0, 0, 4], [1, 1, 1], V, "cpu", histories)
    out = Sampler()(logits, meta)
    assert out.token_ids[1].item() == 17 != logits[1].argmax().item()
    expected = logits[1].clone()
    expected[17] += 100.0
    expected[3] -= 5.0
    after = apply_logits_processors(logits, meta)
    assert torch.equal(after[1], expected) and torch.equal(after[[0, 2]], logits[[0, 2]])
    alone = Sampler()(logits[[0, 2]], sampling_metadata(plain, [0, 4], [1, 1], V, "cpu"))
    assert torch.equal(out.token_ids[[0, 2]], alone.token_ids)
    assert out.logprobs is not None and alone.logprobs is not None
    assert torch.equal(out.logprobs[[0, 2]], alone.logprobs)
    raw = logits[1].log_softmax(-1)  # the biased row's logprobs: its model's distribution, not the biased one
    assert out.logprob_token_ids is not None
    torch.testing.assert_close(out.logprobs[1], raw[out.logprob_token_ids[1]])


def test_min_tokens_masks_the_stop_ids_until_the_output_is_long_enough() -> None:
    """End-of-sequence ids (unless ignore_eos) and stop_token_ids are -inf while the output has fewer
    than min_tokens tokens; from then on nothing changes."""
    logits = torch.zeros(4, V)
    params = SamplingParams(min_tokens=3, max_tokens=8, stop_token_ids=[11])
    histories = [([1, 2], [4, 4]), ([1, 2], [4, 4, 4]), ([1], []), ([1, 2], [4])]
    batch = [params, params, params, replace(params, ignore_eos=True)]
    out = processed(batch, histories, logits, eos=[7, 9])
    inf = float("-inf")
    assert [[out[r, t].item() for t in (7, 9, 11)] for r in range(4)] == [
        [inf, inf, inf],
        [0, 0, 0],
        [inf, inf, inf],
        [0, 0, inf],
    ]
    assert (out[:, [t for t in range(V) if t not in (7, 9, 11)]] == 0).all()


def test_token_ids_outside_the_vocabulary_are_refused_when_added() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=16)
    vocab = llm.model_config.vocab_size
    prompt = {"prompt_token_ids": [1, 2]}
    for params, name in (
        (SamplingParams(logit_bias={3: 1.0, vocab + 2: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
    ):
        with pytest.raises(
            ValueError, match=f"{name} names token id {vocab + 2 if name == 'logit_bias' else vocab}.*{vocab} tokens"
        ):
            llm.add_request(prompt, params)
    assert not llm.has_unfinished_requests()


# ---- through the engine --------------------------------------------------------------


def engine(**kwargs: Any) -> LLM:
    return LLM(
        "tiny", device="cpu", **{"attention_backend": "TORCH_REF", "block_size": 4, "dtype": "float32", **kwargs}
    )


def reference_next_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].double()


def penalized_reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float64, written out token by token (the order of vllm/model_executor/layers/utils.py apply_penalties)."""
    logits = logits.clone()
    for token in set(prompt + output):
        logits[token] = (
            logits[token] / p.repetition_penalty if logits[token] > 0 else logits[token] * p.repetition_penalty
        )
    for token, count in Counter(output).items():
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    return logits


class HistoryCheck:
    """A step listener: every penalized row counted exactly its request's tokens before its position
    (prompt, outputs so far; under async scheduling the token the previous step left on the device)."""

    def __init__(self, llm: LLM) -> None:
        self.rows_checked = 0
        llm.add_step_listener(self)

    def __call__(self, event: StepEvent) -> None:
        meta = event.result.sampling_metadata
        if meta is None or meta.penalties is None or event.result.draft_token_ids is not None:
            return
        p, requests = meta.penalties, {s.request.request_id: s.request for s in event.scheduler_output.scheduled}
        for i, row in enumerate(p.rows.tolist()):
            request = requests[event.result.batch.sampling_req_ids[row]]
            position = int(p.positions[i])
            # The request's known tokens: under async scheduling the last may still be on its way.
            known = min(position, request.num_tokens)
            assert p.token_ids[i, :known].tolist() == request.all_token_ids[:known]
            assert int(p.num_prompt_tokens[i]) == request.num_prompt_tokens
            self.rows_checked += 1


PENALIZED = [
    replace(GREEDY, repetition_penalty=1.6),
    replace(GREEDY, presence_penalty=1.2, frequency_penalty=0.8),
    replace(GREEDY, repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias={11: 3.0}),
]


def test_greedy_penalties_through_generate_follow_transformers_float64() -> None:
    """Each penalized request's tokens are the argmax of transformers' float64 logits penalized by hand,
    step by step (teacher forcing on the engine's tokens: each must be the reference's best, within
    float32's error); a mixed batch, with an unpenalized greedy request that keeps its own tokens."""
    llm = engine(num_kv_blocks=48)
    check = HistoryCheck(llm)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    outs = llm.generate(prompts, [*PENALIZED, GREEDY])
    plain = llm.generate(prompts[:3], GREEDY)
    assert outs[3].outputs[0].token_ids == plain[1].outputs[0].token_ids
    hf = to_transformers(llm.model)
    for params, prompt, out, unpenalized in zip(PENALIZED, prompts, outs, plain):
        ids, generated = prompt["prompt_token_ids"], out.outputs[0].token_ids
        assert generated != unpenalized.outputs[0].token_ids, "the penalty changed nothing: a weak test"
        for k, token in enumerate(generated):
            ref = penalized_reference(reference_next_logits(hf, ids + generated[:k]), params, ids, generated[:k])
            for t, bias in (params.logit_bias or {}).items():
                ref[t] += bias  # before the penalties, as vLLM; a bias of 3 on a positive logit r > 1 shrinks it
            assert ref[token] >= ref.max() - 1e-3, (k, token, int(ref.argmax()))
    assert check.rows_checked > 0


def test_logit_bias_before_the_penalties() -> None:
    """vLLM's order: bias, then repetition penalty: a biased, seen token with logit x gets (x + b) / r."""
    logits = torch.full((1, V), 1.0)
    out = processed([SamplingParams(repetition_penalty=2.0, logit_bias={5: 3.0})], [([5], [])], logits)
    assert out[0, 5].item() == (1.0 + 3.0) / 2.0 and out[0, 6].item() == 1.0


def test_min_tokens_holds_back_an_end_of_sequence_that_comes_first() -> None:
    """With the model's second greedy token as its end-of-sequence id, a request stops after 2 tokens;
    with min_tokens=5 it goes on, its first 5 tokens being the argmax with that id masked."""
    llm = engine(num_kv_blocks=32)
    free = llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    llm.eos_token_ids = [free[1]]
    stopped = llm.generate([PROMPTS[0]], replace(GREEDY, ignore_eos=False))[0].outputs[0]
    assert stopped.token_ids == free[:2] and stopped.finish_reason == "stop"
    held = llm.generate([PROMPTS[0]], replace(GREEDY, ignore_eos=False, min_tokens=5))[0].outputs[0]
    assert len(held.token_ids) >= 5 and free[1] not in held.token_ids[:5]
    hf, ids = to_transformers(llm.model), PROMPTS[0]["prompt_token_ids"]
    for k, token in enumerate(held.token_ids[:5]):
        ref = reference_next_logits(hf, ids + held.token_ids[:k])
        ref[free[1]] = float("-inf")
        assert ref[token] >= ref.max() - 1e-3


SEEDED = replace(GREEDY, temperature=0.9, seed=5, presence_penalty=1.0, repetition_penalty=1.3)
MIXED = ([PROMPTS[0], PROMPTS[1], PROMPTS[1]], [PENALIZED[0], SEEDED, PENALIZED[1]])
"""Greedy and seeded penalized requests: their tokens must not depend on how the engine runs them."""


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = engine(num_kv_blocks=48, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(*MIXED)]


@pytest.mark.parametrize(
    "config",
    [
        {"speculative_config": NGRAM},
        {"speculative_config": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}},
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": True, "num_kv_blocks": 14, "max_num_batched_tokens": 12},  # preemption, chunks
    ],
    ids=["ngram", "draft-model", "prefix-cache-hit", "preempted"],
)
def test_the_tokens_of_a_plain_run(config: dict[str, Any], plain: list[list[int]]) -> None:
    """Drafts (n-gram on the host, a draft model's on the device; kept iff they equal the token drawn
    at their position), a second run read from the prefix cache, preemption and chunked prefill: the
    penalized tokens of a plain engine, greedy and seeded alike."""
    llm = engine(**{"num_kv_blocks": 48, "enable_prefix_caching": False, **config})
    check = HistoryCheck(llm)
    llm.generate([{"prompt_token_ids": [2] * 9}], GREEDY)  # the rows hold other tokens now
    for _ in range(2):  # the second time, each prompt's full blocks may come from the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(*MIXED)] == plain
    if "speculative_config" in config:
        assert llm.stats.num_draft_tokens > llm.stats.num_accepted_tokens > 0
    else:
        assert check.rows_checked > 0 and llm.stats.num_cached_tokens >= 8
    if "num_kv_blocks" in config:
        assert llm.stats.num_preemptions > 0


def test_tensor_parallel_ranks_get_no_token_history_and_sample_the_same() -> None:
    """Under TP=2 rank 0 samples (the workers get each step's parameters pickled, without the token
    list): the penalized tokens of one rank, a prefix-cache hit included."""
    import pickle

    from pagedkv.engine.request import Request
    from pagedkv.engine.sampler import row_sampling_params

    row = row_sampling_params(Request("r", [1, 2, 3], PENALIZED[0], [7]), V)
    assert list(row.token_ids) == [1, 2, 3] and pickle.loads(pickle.dumps(row)) == row
    assert pickle.loads(pickle.dumps(row)).token_ids == ()
    prompts, params = [PROMPTS[0], PROMPTS[1]], [PENALIZED[0], PENALIZED[1]]
    plain = [o.outputs[0].token_ids for o in engine(num_kv_blocks=48).generate(prompts, params)]
    with engine(num_kv_blocks=48, tensor_parallel_size=2, enable_prefix_caching=True) as llm:
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
