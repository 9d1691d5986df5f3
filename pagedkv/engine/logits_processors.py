"""What changes the logits before a token is drawn: logit bias, min_tokens, presence / frequency /
repetition penalties, batched over the rows that have them.

In vLLM V1's order (vllm/v1/sample/sampler.py): first the sparse additions, each row's logit_bias and,
while its output is shorter than min_tokens, -inf on the tokens that would end it; then the penalties,
which read how often each token occurs before the position the row draws:

    repetition r   a token of the prompt or the output: logit / r if logit > 0 else logit * r
                   (the CTRL paper's, as transformers' RepetitionPenaltyLogitsProcessor applies it)
    frequency  f   logit -= f * (times the output holds the token)
    presence   p   logit -= p * (the output holds the token at all)

then temperature, min-p, top-k and top-p (pagedkv/engine/sampler.py). The logprobs a request asks for
stay those of the model's own distribution (vLLM's default, `raw_logprobs`).

The counts are taken afresh every step from the row's tokens on the device (one scatter_add over
the penalized rows' tokens), where vLLM's Model Runner V2 keeps running bin counts
(vllm/v1/worker/gpu/sample/penalties.py). Recounting costs a pass over each penalized row's tokens,
but keeps nothing between steps: a row under speculative decoding counts exactly the tokens before
its own position (its drafts up to there included), an interrupted step has nothing to restore, and
async scheduling's tokens, written into the rows on the device, are counted like any other.

Rows without any of these are left alone bit for bit, and a batch where no row has one runs no
extra kernel: `SamplingMetadata.penalties` / `.adjustments` are then None (host-side summaries).
"""

from __future__ import annotations

import torch

from pagedkv.worker.sampling_metadata import LogitAdjustments, PenaltyInputs, SamplingMetadata


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [rows, vocab] float32 with each row's adjustments and penalties applied: the same tensor
    when no row has any, else a new one (the caller's logits, which the logprobs read, are kept)."""
    if meta.adjustments is None and meta.penalties is None:
        return logits
    logits = logits.clone()
    if meta.adjustments is not None:
        add_adjustments(logits, meta.adjustments, meta.positions)
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def add_adjustments(logits: torch.Tensor, adjustments: LogitAdjustments, positions: torch.Tensor) -> None:
    """In place: every entry still in force added to its (row, token), in one index_put. An entry out
    of force adds 0.0 (exact); a -inf stays -inf whatever bias is added to it."""
    a = adjustments
    values = torch.where(positions[a.rows] < a.until, a.values, 0.0)
    logits.index_put_((a.rows, a.token_ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> None:
    """In place, on the rows `p` names (vLLM's order: repetition, then frequency, then presence).

    Only the tokens a row holds can change (a repetition penalty applies to every one of them, the
    others to output tokens, which are among them): so each row's [width] history columns are
    gathered, penalized and scattered back, and the whole vocabulary is touched once, by the zeros
    the output counts are added into. A token held at several positions is written as many times,
    always with the same value. A penalty at its neutral value changes nothing, bit for bit."""
    columns = torch.arange(p.token_ids.shape[1], device=p.token_ids.device)
    before = columns < p.positions[:, None]
    in_output = before & (columns >= p.num_prompt_tokens[:, None])
    # A column at or past the row's position holds anything (a rejected draft, the last owner's
    # token): it stands in for the row's first token instead (a row draws at position 1 or later),
    # so it changes nothing that the first column does not change the same way.
    token_ids = p.token_ids.long()
    token_ids = torch.where(before, token_ids, token_ids[:, :1])
    zeros = torch.zeros(token_ids.shape[0], logits.shape[1], dtype=torch.float32, device=logits.device)
    # Counts below 2**24 are exact in float32, whatever order the scatter adds them in.
    counts = zeros.scatter_add_(1, token_ids, in_output.float()).gather(1, token_ids)
    where = (p.rows[:, None], token_ids)
    held = logits[where]
    r = p.repetition[:, None]
    held = torch.where(held > 0, held / r, held * r)
    logits[where] = held - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)
