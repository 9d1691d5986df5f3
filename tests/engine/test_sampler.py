"""The batched sampler against a float64 reference of what each filter means.

The reference (`reference_probs`) is written out here in float64, one row at a time and without
the sampler's tricks (no candidate columns, no exponential race): temperature, then min-p, then
top-k (ties at the k-th value kept), then top-p, then the softmax. The sampler's draws must follow
it (a chi-square test over thousands of rows drawn in one call), greedy rows must be the argmax
bit for bit, and a seeded request must draw the same tokens whatever else is in its batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution, in float64, straight from the definitions."""
    x = logits.double() / p.temperature
    x = torch.where(x.softmax(-1) >= p.min_p * x.softmax(-1).max(), x, -math.inf)
    if p.top_k:
        x = torch.where(x >= x.topk(p.top_k).values[-1], x, -math.inf)
    probs = x.softmax(-1)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    kept, total = [], 0.0
    for i in order:  # the most likely tokens until they reach top_p
        if total >= p.top_p:
            break
        kept.append(i)
        total += probs[i].item()
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[kept] = True
    probs = torch.where(mask, probs, 0.0)
    return probs / probs.sum()


def draw(
    sampler: Sampler, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]
) -> list[int | Exception]:
    """One call's token per request (one row each), or the error that ended it."""
    out = sampler(logits, req_ids, params).to_host().rows(req_ids, params)
    assert all(isinstance(tokens, Exception) or len(tokens) == 1 for tokens, _ in out)
    return [tokens if isinstance(tokens, Exception) else tokens[0] for tokens, _ in out]


LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0, -3.5, -6.0])
FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, top_k=6, top_p=0.7),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, min_p=0.05, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("filters", FILTERS, ids=[",".join(f"{k}={v}" for k, v in f.items()) for f in FILTERS])
def test_draws_follow_the_float64_distribution(filters: dict) -> None:
    torch.manual_seed(0)
    n = 20000
    params = SamplingParams(**filters)
    tokens = draw(Sampler(), LOGITS.repeat(n, 1), [str(i) for i in range(n)], [params] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double()
    expected = reference_probs(LOGITS, params) * n
    assert counts[expected == 0].sum() == 0, "a token the filters drop was drawn"
    keep = expected > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    # 99.9th percentile of chi-square with (kept - 1) <= 9 degrees of freedom: 27.9.
    assert chi2 < 27.9, f"chi2 = {chi2:.1f} for {filters}: counts {counts.tolist()}, expected {expected.tolist()}"


def test_mixed_batch_rows_each_follow_their_own_parameters() -> None:
    """Greedy, top-k, and whole-vocabulary rows interleaved in one batch (rows are regrouped
    inside the sampler and must come back in their places)."""
    torch.manual_seed(1)
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]
    n = 9000
    params = [kinds[i % 3] for i in range(n)]
    tokens = torch.tensor(draw(Sampler(), LOGITS.repeat(n, 1), [str(i) for i in range(n)], params))
    assert (tokens[0::3] == 0).all()
    assert set(tokens[1::3].tolist()) == {0, 1}
    assert len(set(tokens[2::3].tolist())) > 5


def test_greedy_rows_are_the_argmax_bit_for_bit() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 5000) * 3
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=0.7, top_k=20) for i in range(64)]
    tokens = draw(Sampler(), logits, [str(i) for i in range(64)], params)
    assert tokens[1::2] == logits.argmax(-1)[1::2].tolist()


def test_top_p_keeps_the_nucleus_and_a_tie_keeps_the_lower_id() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for top_k in (0, 3):  # through the whole vocabulary and through the top-k candidates
        params = [SamplingParams(temperature=1.0, top_p=0.7, top_k=top_k)] * 2000
        assert set(draw(Sampler(), logits.repeat(2000, 1), [str(i) for i in range(2000)], params)) == {0, 1}
    # top_k=2 alone keeps {0, 1}, top_p=0.6 alone too; together (0.625, 0.375 over the two kept) only 0.
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)] * 500
    assert set(draw(Sampler(), logits.repeat(500, 1), [str(i) for i in range(500)], params)) == {0}
    # Two equal tokens, top_p 0.5: the first alone reaches it.
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 500
    assert set(draw(Sampler(), torch.zeros(500, 2), [str(i) for i in range(500)], params)) == {0}


def test_a_seeded_request_draws_the_same_tokens_in_any_batch() -> None:
    """Its noise comes from its own generator only: alone, or beside other rows (with other top-k
    or none, which changes the width of the batch's candidate columns), it draws the same tokens."""
    torch.manual_seed(3)
    steps = [torch.randn(1000) for _ in range(6)]
    for seeded in (SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, top_k=40, seed=11)):
        alone, crowd = Sampler(), Sampler()
        others = [SamplingParams(temperature=1.0, top_k=200), SamplingParams(temperature=0.7), SamplingParams(seed=5)]
        a = [draw(alone, x[None], ["r"], [seeded])[0] for x in steps]
        b = [
            draw(
                crowd,
                torch.stack([torch.randn(1000), x, torch.randn(1000), torch.randn(1000)]),
                ["o1", "r", "o2", "o3"],
                [others[0], seeded, others[1], others[2]],
            )[1]
            for x in steps
        ]
        assert a == b
        assert len({draw(Sampler(), steps[0][None], ["r"], [seeded])[0] for _ in range(3)}) == 1


def test_a_seeded_request_draws_new_numbers_every_step() -> None:
    sampler, params = Sampler(), SamplingParams(temperature=1.0, seed=3)
    picks = [draw(sampler, torch.zeros(1, 1000), ["r"], [params])[0] for _ in range(20)]
    assert len(set(picks)) > 10  # a generator seeded again each step would draw the same token 20 times


def test_logprobs_are_the_models_log_softmax() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.9, logprobs=0),
        SamplingParams(temperature=0.9),
    ]
    out = Sampler()(logits, ["a", "b", "c"], params).to_host().rows(["a", "b", "c"], params)
    reference = logits.double().log_softmax(-1)
    ([t0], [lp0]), ([t1], [lp1]), (_, lp2) = out
    top3 = reference[0].topk(3).indices.tolist()
    assert set(lp0) == {t0, *top3} and t0 == top3[0]
    assert list(lp1) == [t1] and lp2 is None
    for row, lps in ((0, lp0), (1, lp1)):
        for token, lp in lps.items():
            assert abs(lp - reference[row, token].item()) < 1e-5


def test_a_row_of_nan_fails_alone() -> None:
    logits = torch.randn(4, 30)
    logits[1] = math.nan
    logits[3] = -math.inf
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
    ]
    out = draw(Sampler(), logits, list("abcd"), params)
    assert isinstance(out[1], ValueError) and "request b" in str(out[1]) and isinstance(out[3], ValueError)
    assert isinstance(out[0], int) and out[2] == logits[2].argmax().item()


def test_the_engines_logprobs_are_transformers_float64_log_softmax() -> None:
    """Through `generate`, sampled with a temperature (logprobs are of the model's own distribution,
    before it): each token's entry, and the 2 most likely, against transformers in float64."""
    from pagedkv import LLM
    from pagedkv.models.hf_export import to_transformers
    from tests.reference import reference_logits

    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 7]}, {"prompt_token_ids": [3, 3, 8]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, logprobs=2))
    hf = to_transformers(llm.model)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        reference = reference_logits(hf, prompt["prompt_token_ids"], completion.token_ids).log_softmax(-1)
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert set(entry) == {token, *reference[k].topk(2).indices.tolist()}
            for t, lp in entry.items():
                assert abs(lp - reference[k, t].item()) < 1e-4
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
