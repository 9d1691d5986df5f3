"""Verification of speculative decoding's drafts: each request's k drafts against the target model, in one batch.

Speculative decoding schedules a request with its last token and k drafts; the target's forward gives
1 + k rows of logits, row j its distribution p_j for the token at position n + j. Every row draws its own
token t_j exactly as the `Sampler` draws it (pagedkv/engine/sampler.py): greedy rows the argmax, random
rows the inverse CDF of p_j at the uniform hashed from (the request's seed, the row's position). Then

    draft x_j is kept iff x_j == t_j; the request emits its kept drafts, then t at the first mismatch
    (or t of its last row, the bonus token, when every draft was kept).

Every emitted token is t at its position, the token the Sampler would have drawn there without drafts:
so a seeded request's tokens are the same with or without drafts, whatever the proposer, the token
budget or preemption did to how many drafts it got, and the output is exactly the target's
distribution for any proposer. Penalties, logit_bias and min_tokens are part of each row's draw (the
Sampler applies them, pagedkv/engine/logits_processors.py): row j counts the tokens before its own
position, its request's drafts up to there included, which are its true history whenever its token is
emitted (every draft before it was kept). For greedy rows this is the usual rule (drafts kept while
equal to the argmax; vLLM's vllm/v1/sample/rejection_sampler.py, unchanged here).

Why exact match rather than the rejection rule (keep x with probability min(1, p(x) / q(x)), on a
rejection draw from norm(max(0, p - q))) that vLLM's v1 RejectionSampler implements: with a
deterministic proposer (n-gram lookup, a greedy draft model: q one-hot at x) both keep x with
probability p(x), so exact match costs no acceptance at all, and it is what makes the tokens independent
of the drafts: the rejection rule's recovered token is drawn from p without x, a different draw from the
Sampler's, so the drafts a request happens to get would change its tokens. Only a sampling drafter
(q not one-hot) would lose: exact match keeps a draft with probability sum_x p(x) q(x) where the
rejection rule keeps it with sum_x min(p(x), q(x)). Measured on the CPU (benchmarks/spec_acceptance.py,
benchmarks/results/spec_acceptance_cpu_2026-12-07.json): tiny-pydoc with its own first 2 of 4 layers as the
draft model, k = 3, 79 prompts x 96 tokens, ~6,900 drafts reaching verification per temperature:

    temperature   kept by exact match   rejection rule: mean p(x)   sampling drafter: sum pq / sum min(p, q)
    0.6           0.485                 0.485                       0.464 / 0.465
    1.0           0.485                 0.485                       0.421 / 0.428
    1.3           0.476                 0.475                       0.370 / 0.392

(the engine's exact-match rate and, on the same drafts, the rejection rule's expected rate). So with
pagedkv's proposers (greedy draft model, n-gram) exact match costs nothing; it is kept. A sampling drafter
would lose 0.1 to 2 points here (this draft model's distributions are sharp), and would then want the
rejection rule back, at the price of tokens that depend on the drafts.

All of it is batched over the [rows, vocab] logits, with no host sync.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.engine.sampler import Sampler, SamplerOutput
from pagedkv.worker.sampling_metadata import SamplingMetadata
from pagedkv.worker.states import to_device


class RejectionSampler:
    """Speculative decoding's verification: each row's token drawn as the Sampler draws it, each draft
    kept iff it equals its row's token; stateless, like the Sampler it uses."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        """Draws every row's token (and its logprobs): the verification is the Sampler's own draws."""

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        num_draft_tokens: list[int],
        draft_token_ids: torch.Tensor,
    ) -> SamplerOutput:
        """logits [sum(1 + k_i), vocab], request i's 1 + k_i rows in request order (`meta` one entry per
        row: a request's rows share its parameters and seed, their positions count up); its k_i drafts
        packed in `draft_token_ids` [sum k_i] (int64, on the logits' device) -> the tokens to emit."""
        device = logits.device
        num_rows = [1 + k for k in num_draft_tokens]
        if logits.shape[0] != sum(num_rows) or draft_token_ids.shape != (sum(num_draft_tokens),):
            raise ValueError(
                f"{len(num_rows)} requests with {sum(num_draft_tokens)} drafts need {sum(num_rows)} rows of logits "
                f"and {sum(num_draft_tokens)} draft ids, got {logits.shape[0]} and {tuple(draft_token_ids.shape)}"
            )
        sampled = self.sampler(logits, meta)
        row_request = [i for i, n in enumerate(num_rows) for _ in range(n)]
        place = [j for n in num_rows for j in range(n)]  # the row's place among its request's rows
        # Per row: its draft x_j, or -1 on a request's last row (the bonus row, which has none).
        draft_rows = [row for row, (i, j) in enumerate(zip(row_request, place)) if j < num_draft_tokens[i]]
        drafts = torch.full((len(row_request),), -1, dtype=torch.long, device=device)
        if draft_rows:
            drafts = drafts.index_copy(0, to_device(draft_rows, device), draft_token_ids)
        accepted = drafts == sampled.token_ids
        # A request emits its rows up to the first one not accepted (a rejected draft, a failed row or
        # its bonus row, which is never accepted): num_tokens = that row's place in the request + 1.
        stop = torch.where(accepted & ~sampled.failed, len(row_request), to_device(place, device))
        first_stop = torch.full((len(num_rows),), len(row_request), dtype=torch.long, device=device)
        first_stop = first_stop.scatter_reduce(0, to_device(row_request, device), stop, reduce="amin")
        return dataclasses.replace(sampled, num_rows=num_rows, num_tokens=first_stop + 1)
