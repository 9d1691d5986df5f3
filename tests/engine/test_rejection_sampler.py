"""The rejection sampler against independent references.

Greedy: the emitted tokens are worked out here from the definition (drafts accepted while they equal
the row's argmax, then that row's argmax). Random: the empirical distribution of each emitted token,
over tens of thousands of requests drawn in one call, against `reference_probs` (float64, straight
from the filters' definitions, tests/engine/test_sampler.py): verification must keep the target's
distribution at every position, whatever the drafts were; and every emitted token must be the one the
Sampler draws at its position without drafts (exact match: a draft is kept iff it equals that token).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.rejection_sampler import RejectionSampler
from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler, sampling_metadata
from pagedkv.worker.sampling_metadata import SamplingMetadata
from tests.engine.test_sampler import reference_probs

GREEDY = SamplingParams(temperature=0)


def verify(
    logits: torch.Tensor,
    params: list[SamplingParams],
    drafts: list[list[int]],
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> list[list[int] | Exception]:
    """Each request's emitted tokens (or its error) for its `drafts` (request i has 1 + len(drafts[i])
    rows of `logits`, in order; its seed `seeds[i]` (default i), its rows at positions
    `positions[i]`, `positions[i] + 1`, ... (default 0, 1, ...))."""
    req_ids = [str(i) for i in range(len(params))]
    out = RejectionSampler(Sampler())(logits, *spec_inputs(logits, params, drafts, seeds, positions))
    return [tokens for tokens, _ in out.to_host().rows(req_ids, params)]


def spec_inputs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    drafts: list[list[int]],
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> tuple[SamplingMetadata, list[int], torch.Tensor]:
    """The RejectionSampler's arguments after the logits: per-row metadata, draft counts, packed drafts."""
    seeds = list(range(len(params))) if seeds is None else seeds
    positions = [0] * len(params) if positions is None else positions
    rows = [(p, s, start + j) for p, s, start, d in zip(params, seeds, positions, drafts) for j in range(1 + len(d))]
    meta = sampling_metadata([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], logits.shape[1], "cpu")
    draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    return meta, [len(d) for d in drafts], draft_ids


def greedy_reference(argmax: list[int], drafts: list[int]) -> list[int]:
    """The definition: drafts accepted while each equals its row's argmax, then one more argmax."""
    emitted = []
    for row, draft in enumerate(drafts):
        if draft != argmax[row]:
            return emitted + [argmax[row]]
        emitted.append(draft)
    return emitted + [argmax[len(drafts)]]


def test_greedy_hand_worked_drafts() -> None:
    """k = 3 rows whose argmax is 7, 2, 5, 1: all accepted, rejected at each position, and k = 0."""
    argmax = [7, 2, 5, 1]
    logits = torch.full((4, 10), -1.0)
    logits[range(4), argmax] = 3.0
    cases = {
        (7, 2, 5): [7, 2, 5, 1],  # all accepted: the three drafts and the bonus argmax
        (0, 2, 5): [7],  # rejected at 0: row 0's argmax only
        (7, 9, 5): [7, 2],
        (7, 2, 4): [7, 2, 5],
    }
    for drafts, expected in cases.items():
        assert verify(logits, [GREEDY], [list(drafts)]) == [expected] == [greedy_reference(argmax, list(drafts))]
    assert verify(logits[:1], [GREEDY], [[]]) == [[7]]


def test_greedy_batch_of_random_drafts_is_the_argmax_per_row() -> None:
    """Many requests, k from 0 to 4, drafts mostly right (so every accepted length occurs)."""
    gen = torch.Generator().manual_seed(0)
    ks = [int(k) for k in torch.randint(0, 5, (200,), generator=gen)]
    logits = torch.randn(sum(ks) + len(ks), 50, generator=gen)
    argmax, drafts, row = logits.argmax(-1).tolist(), [], 0
    for k in ks:
        right = torch.rand(k, generator=gen) < 0.7
        drafts.append([argmax[row + j] if right[j] else (argmax[row + j] + 1) % 50 for j in range(k)])
        row += k + 1
    out, row = verify(logits, [GREEDY] * len(ks), drafts), 0
    for k, d, tokens in zip(ks, drafts, out):
        assert tokens == greedy_reference(argmax[row : row + k + 1], d)
        row += k + 1
    assert {len(t) - 1 for t in out} == set(range(5))


FILTERS = [
    dict(temperature=0.8, top_k=6),  # through the top-k candidates
    dict(temperature=1.3, top_p=0.8),  # through the whole vocabulary
    dict(temperature=1.0, min_p=0.05, top_k=10, top_p=0.9),
]
PATTERNS = ["most likely", "unlikely", "zero probability"]


def draft_for(p: torch.Tensor, pattern: str) -> int:
    if pattern == "most likely":
        return int(p.argmax())
    if pattern == "unlikely":
        return int(torch.where(p > 0, p, math.inf).argmin())
    return int((p == 0).nonzero()[0])


def total_variation_bound(p: torch.Tensor, n: int) -> float:
    """1.5 * sum_i sd_i, with sd_i = sqrt(p_i (1 - p_i) / n) the standard deviation of token i's
    frequency: TV = 1/2 sum_i |f_i - p_i| goes past it only if the deviations average 3 sd, while
    E|f_i - p_i| = 0.8 sd; a biased sampler moves TV by its bias (e.g. (1 - p(x)) p(x) for a
    recovered token drawn without removing x: 0.1 to 0.25 here, the bound is about 0.01 to 0.05)."""
    return 1.5 * (p * (1 - p) / n).sqrt().sum().item()


@pytest.mark.parametrize("filters", FILTERS, ids=[",".join(f"{k}={v}" for k, v in f.items()) for f in FILTERS])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_emitted_token_follows_the_target_distribution(filters: dict, pattern: str) -> None:
    """Two populations of 20,000 requests with k = 2 drafts, in one call: A's drafts (x0, x1) both
    follow the pattern, B's x0 is row 0's most likely token (so that many get to position 1) and x1
    follows it. The token emitted at position j, among the requests whose drafts before j were
    accepted, is distributed as row j's p: position 0 over A, positions 1 and 2 over B (2 where at
    least 2,000 requests get there)."""
    gen = torch.Generator().manual_seed(sum(map(ord, pattern + str(filters))))
    vocab = int(torch.randint(8, 17, (1,), generator=gen))
    rows = torch.randn(3, vocab, generator=gen) * 1.5
    params = SamplingParams(**filters)
    probs = [reference_probs(row, params) for row in rows]
    x0, x1 = draft_for(probs[0], pattern), draft_for(probs[1], pattern)
    n = 20000
    drafts = [[x0, x1]] * n + [[draft_for(probs[0], "most likely"), x1]] * n
    out = RejectionSampler(Sampler())(
        rows.repeat(2 * n, 1), *spec_inputs(rows.repeat(2 * n, 1), [params] * (2 * n), drafts)
    )
    assert out.num_tokens is not None and not out.failed.any()
    tokens, num_tokens = out.token_ids.view(2 * n, 3), out.num_tokens
    assert ((1 <= num_tokens) & (num_tokens <= 3)).all()
    populations = {0: slice(0, n), 1: slice(n, 2 * n), 2: slice(n, 2 * n)}
    checked = []
    for j, population in populations.items():  # position j: requests whose first j drafts were accepted
        reached = tokens[population, j][num_tokens[population] > j]
        if len(reached) < 2000:
            continue
        counts = torch.bincount(reached, minlength=vocab).double()
        assert counts[probs[j] == 0].sum() == 0, f"position {j}: a token of probability 0 was emitted"
        tv = 0.5 * (counts / len(reached) - probs[j]).abs().sum().item()
        bound = total_variation_bound(probs[j], len(reached))
        assert tv < bound, f"position {j}: TV {tv:.4f} >= {bound:.4f}: {counts.tolist()} vs {probs[j].tolist()}"
        checked.append(j)
    assert checked[:2] == [0, 1]


def test_every_emitted_token_is_the_samplers_draw_at_its_position() -> None:
    """Exact match: whatever the drafts (right, wrong, absent), the token emitted at position n is the one
    the Sampler draws from that row's logits at position n without drafts; so a seeded request's tokens
    are the same with or without drafts. Drafts are kept iff they equal those draws."""
    gen = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.7, top_k=20, seed=8),
        GREEDY,
        SamplingParams(temperature=1.2, top_p=0.9, min_p=0.02),
    ]
    for trial in range(30):
        logits = torch.randn(4 * 4, 60, generator=gen) * 2
        seeds, starts = [7, 8, 0, 1000 + trial], [trial, 3 * trial, 5, 2]
        # Each request's own draws at its 4 positions, one row at a time, by the Sampler.
        own = [
            [
                Sampler()(logits[4 * i + j][None], sampling_metadata([p], [s], [start + j], 60, "cpu")).token_ids.item()
                for j in range(4)
            ]
            for i, (p, s, start) in enumerate(zip(params, seeds, starts))
        ]
        # Drafts: right up to a random place, then random (sometimes right again by chance).
        drafts = []
        for t in own:
            right = int(torch.randint(0, 4, (1,), generator=gen))
            drafts.append(t[:right] + torch.randint(0, 60, (3 - right,), generator=gen).tolist())
        emitted = verify(logits, params, drafts, seeds, starts)
        for t, d, e in zip(own, drafts, emitted):
            kept = next((j for j in range(3) if d[j] != t[j]), 3)
            assert e == t[: kept + 1]


def test_without_drafts_a_seeded_request_draws_what_the_sampler_draws() -> None:
    logits = torch.randn(4, 100)
    params = [SamplingParams(seed=7), SamplingParams(temperature=0.7, top_k=20, seed=8), GREEDY, SamplingParams(seed=9)]
    req_ids = [str(i) for i in range(4)]
    for position in range(3):
        meta = sampling_metadata(params, [7, 8, 0, 9], [position] * 4, 100, "cpu")
        plain = Sampler()(logits, meta).rows(req_ids, params)
        assert verify(logits, params, [[]] * 4, [7, 8, 0, 9], [position] * 4) == [tokens for tokens, _ in plain]


def test_a_seeded_request_draws_the_same_tokens_in_any_batch() -> None:
    """Same seed, logits, positions and drafts: the same tokens alone, beside other requests, and again."""
    gen = torch.Generator().manual_seed(3)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    steps = [torch.randn(4, 30, generator=gen) for _ in range(5)]
    drafts = [[int(x[j].argmax()) if j % 2 else 3 for j in range(3)] for x in steps]
    a = [verify(x, [seeded], [d], [11], [4 * n])[0] for n, (x, d) in enumerate(zip(steps, drafts))]
    others = [SamplingParams(temperature=0.9, seed=1), SamplingParams(top_k=5)]
    b = [
        verify(
            torch.cat([torch.randn(2, 30), x, torch.randn(1, 30)]),
            [others[0], seeded, others[1]],
            [[1], d, []],
            [1, 11, 2],
            [7, 4 * n, 0],
        )[1]
        for n, (x, d) in enumerate(zip(steps, drafts))
    ]
    assert a == b
    assert len({tuple(t) for t in a}) > 1  # the positions move on from step to step


def test_num_tokens_rows_and_logprobs_shapes() -> None:
    logits = torch.randn(10, 20)
    logits[9] = math.nan  # request c's bonus row: reached only if its draft is accepted
    argmax = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, top_k=5), GREEDY]
    # a (rows 0-4): k = 4, all accepted; b (rows 5-7): k = 2, rejected first (its draft has
    # probability 0 under top_k=5); c (rows 8-9): k = 1, rejected, so its failed bonus row is not reached.
    b_draft = int(logits[5].argmin())
    drafts = [argmax[:4], [b_draft, 0], [(argmax[8] + 1) % 20]]
    req_ids = ["a", "b", "c"]
    out = RejectionSampler(Sampler())(logits, *spec_inputs(logits, params, drafts)).to_host()
    assert out.num_rows == [5, 3, 2] and out.num_tokens is not None and out.num_tokens.tolist() == [5, 1, 1]
    (a, a_lps), (b, b_lps), (c, c_lps) = out.rows(req_ids, params)
    assert a == argmax[:5] and isinstance(b, list) and len(b) == 1 and b != [b_draft] and c == [argmax[8]]
    assert out.token_ids.shape == (10,) and out.last_token_ids().tolist() == [argmax[4], b[0], argmax[8]]
    assert b_lps is None and c_lps is None and a_lps is not None and len(a_lps) == 5
    reference = logits.double().log_softmax(-1)
    for row, entry in enumerate(a_lps):
        assert list(entry)[0] == argmax[row] and set(entry) == set(reference[row].topk(2).indices.tolist())
        assert all(abs(lp - reference[row, t].item()) < 1e-5 for t, lp in entry.items())
    # c's draft accepted: its failed bonus row is emitted, and ends it.
    (failed,) = verify(logits[8:], [GREEDY], [[argmax[8]]])
    assert isinstance(failed, ValueError) and "NaN" in str(failed)


def test_verification_keeps_no_state() -> None:
    """The same call twice gives the same tokens: nothing to restore when a step is interrupted and run
    again (the engine's interrupt tests, tests/test_interrupts.py, run it through `LLM`)."""
    logits = torch.randn(6, 40)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.5, top_k=10, seed=2)]
    drafts = [[4, 5], [6, 7]]
    rejection = RejectionSampler(Sampler())
    inputs = spec_inputs(logits, params, drafts)
    first, second = (rejection(logits, *inputs) for _ in range(2))
    assert torch.equal(first.token_ids, second.token_ids) and torch.equal(first.num_tokens, second.num_tokens)
    assert vars(rejection.sampler) == {"batch_invariant": False}
