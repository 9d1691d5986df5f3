"""The rejection sampler: verify each request's k draft tokens against the target model, in one batch.

Speculative decoding schedules a request with its last token and k drafts; the target's forward gives
1 + k rows of logits, row j its distribution p_j for the token after position j. As vLLM's
`RejectionSampler` (vllm/v1/sample/rejection_sampler.py), with the drafts chosen deterministically
(n-gram lookup, a greedy draft model: the draft distribution q is one-hot at the draft x_j):

    greedy request:  accept x_j while x_j == argmax p_j; emit them, then the argmax of the first
                     mismatching row (or of the last row: the bonus token). Every row's token is its
                     argmax, so the output is the one the target alone would give.
    random request:  accept x_j with probability p_j(x_j) (u ~ U[0, 1) < p_j(x_j)); at the first
                     rejection emit a draw from p_j with x_j removed (renormalised), the "recovered"
                     token; all k accepted: a draw from p_k, the bonus token.

The random rule keeps the target distribution exactly: the token emitted at position j is x_j with
probability p_j(x_j), and any other y with probability (1 - p_j(x_j)) * p_j(y) / (1 - p_j(x_j)) = p_j(y).
p is the Sampler's own (temperature, min-p, top-k, top-p: `target_probs`), and every draw is its
exponential race, so a request without drafts is sampled exactly as the Sampler samples it. Each row
gets a token (an accepted draft, a recovered or a bonus token); a request emits its first
`num_tokens` rows. All of it is batched over the [rows, vocab] logits, with no host sync.
"""

from __future__ import annotations

import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler, SamplerOutput, argmax_rows, target_probs, to_device, with_logprobs


class RejectionSampler:
    """Speculative decoding's verification: each request's drafts accepted or rejected, then one
    more token, keeping the target's distribution; seeded requests use the Sampler's generators."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        """Its per-request generators and its exponential race are this sampler's too."""

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        params: list[SamplingParams],
        num_draft_tokens: list[int],
        draft_token_ids: torch.Tensor,
    ) -> SamplerOutput:
        """logits [sum(1 + k_i), vocab], request i's 1 + k_i rows in request order; its k_i drafts
        packed in `draft_token_ids` [sum k_i] (int64, on the logits' device) -> the tokens to emit."""
        logits = logits.float()
        device = logits.device
        num_rows = [1 + k for k in num_draft_tokens]
        if logits.shape[0] != sum(num_rows) or draft_token_ids.shape != (sum(num_draft_tokens),):
            raise ValueError(
                f"{len(num_rows)} requests with {sum(num_draft_tokens)} drafts need {sum(num_rows)} rows of logits "
                f"and {sum(num_draft_tokens)} draft ids, got {logits.shape[0]} and {tuple(draft_token_ids.shape)}"
            )
        row_request = [i for i, n in enumerate(num_rows) for _ in range(n)]
        place = [j for n in num_rows for j in range(n)]  # the row's place among its request's rows
        row_params = [params[i] for i in row_request]
        # Per row: its draft x_j, or -1 on a request's last row (the bonus row, which has none).
        draft_rows = [row for row, (i, j) in enumerate(zip(row_request, place)) if j < num_draft_tokens[i]]
        drafts = torch.full((len(row_request),), -1, dtype=torch.long, device=device)
        if draft_rows:
            drafts = drafts.index_copy(0, to_device(draft_rows, device), draft_token_ids)
        tokens, failed = argmax_rows(logits)
        accepted = drafts == tokens  # the greedy rule; random rows are decided below
        with self.sampler.restoring_generators(req_ids):
            generators = [None if p.greedy else self.sampler.generator(r, p, device) for r, p in zip(req_ids, params)]
            uniform = self._uniforms(draft_rows, num_draft_tokens, generators, len(row_request), device)
            for group in target_probs(logits, row_params, self.sampler.batch_invariant):
                group_drafts = group.take(drafts)
                is_draft = group.is_token(group_drafts)
                p_draft = group.probs.masked_fill(~is_draft, 0).sum(dim=-1)
                # u < p(x) / sum(p): p's float32 sum may miss 1 by a rounding; dividing by it means a
                # draft holding all of p is always accepted, never "rejected" into an empty p - {x}.
                group_accepted = group.take(uniform) * group.probs.sum(dim=-1) < p_draft
                # Rows where x is rejected draw from p without x; the bonus row (x = -1) from p.
                race_generators = [generators[row_request[row]] for row in group.rows]
                columns = self.sampler.race(group.probs.masked_fill(is_draft, 0), race_generators, group.widths)
                drawn = torch.where(group_accepted, group_drafts, group.token_ids(columns))
                tokens, accepted = group.put(drawn, tokens), group.put(group_accepted, accepted)
        # A request emits its rows up to the first one not accepted (a rejected draft, a failed row or
        # its bonus row, which is never accepted): num_tokens = that row's place in the request + 1.
        stop = torch.where(accepted & ~failed, len(row_request), to_device(place, device))
        first_stop = torch.full((len(num_rows),), len(row_request), dtype=torch.long, device=device)
        first_stop = first_stop.scatter_reduce(0, to_device(row_request, device), stop, reduce="amin")
        output = SamplerOutput(tokens.masked_fill(failed, 0), failed, num_rows=num_rows, num_tokens=first_stop + 1)
        return with_logprobs(output, logits, row_params, self.sampler.batch_invariant)

    @staticmethod
    def _uniforms(
        draft_rows: list[int],
        num_draft_tokens: list[int],
        generators: list[torch.Generator | None],
        num_rows: int,
        device: torch.device,
    ) -> torch.Tensor:
        """[rows]: u ~ U[0, 1) on each draft row (2 elsewhere: never below a probability); a seeded
        request's from its own generator, before its race noise (a fixed order: same seed, same tokens)."""
        uniform = torch.full((num_rows,), 2.0, device=device)
        if not draft_rows:  # no randomness drawn: without drafts, exactly the Sampler's draws
            return uniform
        drafts_uniform = torch.rand(len(draft_rows), device=device)
        start = 0
        for k, generator in zip(num_draft_tokens, generators):
            if generator is not None and k:
                drafts_uniform[start : start + k].uniform_(generator=generator)
            start += k
        return uniform.index_copy(0, to_device(draft_rows, device), drafts_uniform)
