"""The batched sampler against a float64 reference of what each filter means.

The reference (`reference_probs`) is written out here in float64, one row at a time and without
the sampler's tricks (no candidate columns, no chunked inverse CDF): temperature, then min-p, then
top-k (ties at the k-th value kept), then top-p, then the softmax. The sampler's draws must follow
it (a chi-square test over thousands of rows drawn in one call, their uniforms from many seeds or
from one seed at many positions), greedy rows must be the argmax bit for bit, a row's token must
depend on nothing but its logits, parameters, seed and position, and a filtered token must never be
drawn, not even at the largest uniform.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import CHUNK, Sampler, inverse_cdf, inverse_cdf_chunked, sampling_metadata
from pagedkv.worker.sampling_metadata import (
    DRAFT_SALT,
    TARGET_SALT,
    SamplingMetadata,
    derive_seed,
    uniform_noise,
)


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


def metadata(
    params: list[SamplingParams],
    vocab: int,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Host-built metadata for one row per entry of `params`: by default row i has seed i and
    position 0 (so the rows draw independent uniforms)."""
    seeds = list(range(len(params))) if seeds is None else seeds
    positions = [0] * len(params) if positions is None else positions
    return sampling_metadata(params, seeds, positions, vocab, device)


def draw(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> list[int | Exception]:
    """One call's token per row (one request each), or the error that ended it."""
    req_ids = [str(i) for i in range(len(params))]
    meta = metadata(params, logits.shape[1], seeds, positions, logits.device)
    out = sampler(logits, meta).to_host().rows(req_ids, params)
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


@pytest.mark.parametrize("stream", ["seeds", "positions"])
@pytest.mark.parametrize("filters", FILTERS, ids=[",".join(f"{k}={v}" for k, v in f.items()) for f in FILTERS])
def test_draws_follow_the_float64_distribution(filters: dict, stream: str) -> None:
    """20,000 rows of the same logits, their uniforms from 20,000 seeds at one position, or from one
    seed at 20,000 positions (a request's successive tokens)."""
    n = 20000
    params = SamplingParams(**filters)
    seeds, positions = (None, None) if stream == "seeds" else ([7] * n, list(range(n)))
    tokens = draw(Sampler(), LOGITS.repeat(n, 1), [params] * n, seeds, positions)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double()
    expected = reference_probs(LOGITS, params) * n
    assert counts[expected == 0].sum() == 0, "a token the filters drop was drawn"
    keep = expected > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    # 99.9th percentile of chi-square with (kept - 1) <= 9 degrees of freedom: 27.9.
    assert chi2 < 27.9, f"chi2 = {chi2:.1f} for {filters}: counts {counts.tolist()}, expected {expected.tolist()}"


def test_draws_over_a_vocabulary_of_several_chunks_follow_the_float64_distribution() -> None:
    """The two-level inverse CDF (chunks of CHUNK columns, the last one shorter): the probability mass
    sits in a few tokens spread over different chunks, the rest of the vocabulary almost never drawn."""
    vocab, n = 2 * CHUNK + 300, 20000
    logits = torch.full((vocab,), -30.0)
    hot = [3, CHUNK - 1, CHUNK, CHUNK + 517, 2 * CHUNK, vocab - 1]
    logits[hot] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.8])
    params = SamplingParams(temperature=1.0)
    tokens = torch.tensor(draw(Sampler(), logits.repeat(n, 1), [params] * n))
    expected = reference_probs(logits, params)[hot] * n
    counts = torch.bincount(tokens, minlength=vocab)[hot].double()
    assert counts.sum() >= n - 5  # the other 2,342 tokens hold 2e-10 of the mass
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, f"chi2 = {chi2:.1f}: counts {counts.tolist()}, expected {expected.tolist()}"  # 5 dof, 99.9%


def test_mixed_batch_rows_each_follow_their_own_parameters() -> None:
    """Greedy, top-k, and whole-vocabulary rows interleaved in one batch (each row takes its own path
    inside the sampler and must come back in its place)."""
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]
    n = 9000
    params = [kinds[i % 3] for i in range(n)]
    tokens = torch.tensor(draw(Sampler(), LOGITS.repeat(n, 1), params))
    assert (tokens[0::3] == 0).all()
    assert set(tokens[1::3].tolist()) == {0, 1}
    assert len(set(tokens[2::3].tolist())) > 5


def test_greedy_rows_are_the_argmax_bit_for_bit() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 5000) * 3
    logits[::4, 7] = logits[::4].amax(-1)  # ties: the argmax's own choice among them
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=0.7, top_k=20) for i in range(64)]
    argmax = logits.argmax(-1)
    assert draw(Sampler(), logits, params)[1::2] == argmax[1::2].tolist()
    # A batch of greedy rows only takes another path (no random work at all): the same tokens.
    assert draw(Sampler(), logits, [SamplingParams(temperature=0)] * 64) == argmax.tolist()
    # Beside whole-vocabulary rows with top-p and min-p (every filter computed on the greedy rows too).
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(top_p=0.9, min_p=0.1) for i in range(64)]
    assert draw(Sampler(), logits, params)[1::2] == argmax[1::2].tolist()


def test_top_p_keeps_the_nucleus_and_a_tie_keeps_the_lower_id() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for top_k in (0, 3):  # through the whole vocabulary and through the top-k candidates
        params = [SamplingParams(temperature=1.0, top_p=0.7, top_k=top_k)] * 2000
        assert set(draw(Sampler(), logits.repeat(2000, 1), params)) == {0, 1}
    # top_k=2 alone keeps {0, 1}, top_p=0.6 alone too; together (0.625, 0.375 over the two kept) only 0.
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)] * 500
    assert set(draw(Sampler(), logits.repeat(500, 1), params)) == {0}
    # Two equal tokens, top_p 0.5: the first alone reaches it.
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 500
    assert set(draw(Sampler(), torch.zeros(500, 2), params)) == {0}


def test_a_seeded_request_draws_the_same_tokens_in_any_batch() -> None:
    """A row's token depends on its logits, parameters, seed and position only: alone, or beside other
    rows (with other top-k or none, which changes the width of the batch's candidate columns, with
    top-p or min-p, which adds filters to the batch, or greedy), it draws the same tokens."""
    torch.manual_seed(3)
    steps = [torch.randn(1000) for _ in range(6)]
    others = [
        SamplingParams(temperature=1.0, top_k=200),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(seed=5, min_p=0.2),
        SamplingParams(temperature=0),
    ]
    for seeded in (SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, top_k=40, seed=11)):
        a = [draw(Sampler(), x[None], [seeded], [11], [n])[0] for n, x in enumerate(steps)]
        b = [
            draw(
                Sampler(),
                torch.stack([torch.randn(1000), x, torch.randn(1000), torch.randn(1000), torch.randn(1000)]),
                [others[0], seeded, others[1], others[2], others[3]],
                [3, 11, 4, 5, 6],
                [n + 9, n, n, 2, n],
            )[1]
            for n, x in enumerate(steps)
        ]
        assert a == b
        assert len({draw(Sampler(), steps[0][None], [seeded], [11], [0])[0] for _ in range(3)}) == 1


def test_a_request_draws_new_numbers_at_every_position_and_for_every_seed() -> None:
    params = [SamplingParams(temperature=1.0)] * 20
    by_position = draw(Sampler(), torch.zeros(20, 1000), params, [3] * 20, list(range(20)))
    by_seed = draw(Sampler(), torch.zeros(20, 1000), params, list(range(20)), [4] * 20)
    # A uniform that ignored the position (or the seed) would draw the same token 20 times.
    assert len(set(by_position)) > 10 and len(set(by_seed)) > 10


def test_the_sampler_keeps_no_state() -> None:
    """Nothing per request: the same call twice gives the same tokens, and the object holds its mode only."""
    sampler = Sampler()
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=0.9, seed=i if i % 2 else None, top_k=10 * (i % 3)) for i in range(8)]
    assert draw(sampler, logits, params) == draw(sampler, logits, params)
    assert vars(sampler) == {"batch_invariant": False}


def test_uniform_noise_is_splitmix64_of_seed_position_and_salt() -> None:
    """Against a plain-Python reference (64-bit unsigned arithmetic): the tensor version's wrapping int64
    and masked shifts must give the same bits, for negative seeds and positions far apart too."""

    def mix(x: int) -> int:
        x &= 2**64 - 1
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return x ^ (x >> 31)

    def reference(seed: int, position: int, salt: int) -> float:
        x = mix(mix(seed ^ salt) + position * 0x9E3779B97F4A7C15)
        return (x >> 40) / 2**24

    seeds = [0, 1, -1, 2**62 + 12345, -(2**63), 987654321]
    positions = [0, 1, 5, 2**40, 7, 123456]
    for salt in (TARGET_SALT, DRAFT_SALT):
        got = uniform_noise(torch.tensor(seeds), torch.tensor(positions), salt).tolist()
        assert got == [reference(s, p, salt) for s, p in zip(seeds, positions)]
    u = uniform_noise(torch.arange(50000), torch.zeros(50000, dtype=torch.long), TARGET_SALT)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # The draft stream and the target stream are different numbers (uncorrelated) at the same (seed, position).
    v = uniform_noise(torch.arange(50000), torch.zeros(50000, dtype=torch.long), DRAFT_SALT)
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.02
    # Unseeded requests: seeds hashed from the engine seed and the arrival number, all different.
    assert len({derive_seed(0, n) for n in range(1000)} | {derive_seed(1, n) for n in range(1000)}) == 2000


def test_the_inverse_cdf_never_picks_a_zero_weight_column() -> None:
    """u < 1, but u * total may round up to the total (and the two-level search's residual may exceed its
    chunk's own total by a rounding): the column found must still have a positive weight. Rows of
    weights with zeros before, between and after the positive ones, at u = 0, the largest u and a target
    of exactly the total."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.25, 0.0]])
    cdf = weights.cumsum(-1)
    total = cdf[:, -1]
    assert inverse_cdf(cdf, total, total).tolist() == [3, 4]  # the target rounded up to the total
    assert inverse_cdf(cdf, torch.zeros(2), total).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    wide = torch.rand(64, 3 * CHUNK + 17, generator=gen) * (torch.rand(64, 3 * CHUNK + 17, generator=gen) < 0.01)
    wide[:, -40:] = 0.0  # the last chunk's tail, and in rows 0-7 whole chunks, hold nothing
    wide[:8, CHUNK : 2 * CHUNK] = 0.0
    largest = 1.0 - 2.0**-24  # the largest uniform uniform_noise gives
    # At the largest u, some of these rows' chunk sum exceeds the chunk's own cumulative total (another
    # summation order): without the hold below the total, those rows pick a zero column past the last
    # positive one (checked).
    for u in (torch.zeros(64), torch.full((64,), largest), torch.rand(64, generator=gen)):
        columns = inverse_cdf_chunked(wide, u, invariant=False)
        assert (wide.gather(1, columns[:, None]) > 0).all()


def test_logprobs_are_the_models_log_softmax() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 50) * 4
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.9, logprobs=0),
        SamplingParams(temperature=0.9),
    ]
    out = Sampler()(logits, metadata(params, 50)).to_host().rows(["a", "b", "c"], params)
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
    out = draw(Sampler(), logits, params)
    assert isinstance(out[1], ValueError) and "request 1" in str(out[1]) and isinstance(out[3], ValueError)
    assert isinstance(out[0], int) and out[2] == logits[2].argmax().item()
    logits[0, 3] = math.nan  # one NaN is enough; whole-vocabulary rows too
    assert isinstance(draw(Sampler(), logits[:1], params[:1])[0], ValueError)
    # With a top-k and a top-p too (the top-p cut of a NaN row indexed column -1 and raised for the batch).
    nan_top_p = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9)] * 2
    both = torch.stack([torch.full((30,), math.nan), torch.randn(30)])
    out = draw(Sampler(), both, nan_top_p)
    assert isinstance(out[0], ValueError) and isinstance(out[1], int)


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
