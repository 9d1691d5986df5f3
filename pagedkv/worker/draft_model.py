"""The draft model of speculative decoding: a smaller model in the same runner proposes k tokens.

It is built beside the target with the layer prefix "draft.model", so its attention layers sit in
the same static forward context under their own names, get their own KV cache spec (a KV cache
group of their own when their shapes differ) and their own attention group (another backend or
query-head count). Each step it does two things (after vllm/v1/spec_decode/draft_model.py):

    1. propose, before the target runs: for every decoding request with drafts to fill, k greedy
       forwards of one token each, from its last known token t at position P:
           forward(t @ P) -> d1,  forward(d1 @ P+1) -> d2,  ...,  forward(d(k-1) @ P+k-1) -> dk
    2. catch up, after the target ran: one forward over the target's own batch (prompt chunks,
       [t d1 .. dk]), in the same forward context, so the draft's KV cache holds every token the
       target computed. Accepted drafts' K/V are then right; rejected ones are written again.

Drafts are argmax tokens (a one-hot draft distribution): rejection sampling with one-hot drafts
keeps the target's distribution exactly (pagedkv/engine/rejection_sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.config import EngineConfig
from pagedkv.models.loader import CausalLM, load_config, load_model
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, HostBatch, ScheduledTokens

DRAFT_PREFIX = "draft.model"
"""Where the draft model's layers register (`draft.model.layers.0.self_attn.attn`, ...)."""

DraftForward = Callable[[HostBatch, torch.Tensor | None], torch.Tensor]
"""The runner's draft forward: stage a batch (its token ids replaced by the tensor when given), run
the draft model in a forward context of its own, return the logits at the batch's logits_indices."""


class DraftModelProposer:
    """Greedy drafts from a small model, k forwards of one token per decoding request."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        """The draft model; how many drafts each request gets is the scheduler's plan (its placeholders)."""

    @classmethod
    def load(cls, config: EngineConfig) -> DraftModelProposer | None:
        """The engine's draft model, built and loaded as the target is (inside its config's
        `set_current_engine_config`), or None without one."""
        spec = config.speculative_config
        if spec is None or spec.model is None:
            return None
        model = config.model_config
        draft = load_model(spec.model, load_config(spec.model), model.dtype, config.device, model.seed, DRAFT_PREFIX)
        return cls(draft)

    @staticmethod
    def needs_proposals(host: HostBatch) -> bool:
        """Whether the batch has drafts left for the draft model to fill (placeholders)."""
        return any(host.token_ids[i] == PLACEHOLDER_TOKEN_ID for i in host.draft_indices)

    @torch.inference_mode()
    def propose(self, host: HostBatch, forward: DraftForward) -> torch.Tensor:
        """The drafts of every request of `host` that has some, packed as `host.draft_indices` ([sum k])."""
        rows: list[int] = []  # request rows of host with drafts
        known: list[int] = []  # packed index of each one's last known token
        end = 0
        for i, (query_len, num_drafts) in enumerate(zip(host.query_lens, host.num_draft_tokens)):
            end += query_len
            if num_drafts:
                rows.append(i)
                known.append(end - 1 - num_drafts)
        num_drafts = torch.tensor([host.num_draft_tokens[i] for i in rows])
        longest = int(num_drafts.max())
        drafts: torch.Tensor | None = None  # [len(rows), longest] on the device
        previous: torch.Tensor | None = None
        for j in range(longest):
            active = [r for r, n in enumerate(num_drafts.tolist()) if n > j]
            # Each active request: one token (its last known one, then its latest draft) after the
            # tokens before it, sampled; the token ids after the first forward come from the device.
            one_token_each = [
                ScheduledTokens(
                    host.req_ids[rows[r]],
                    [host.token_ids[known[r]] if j == 0 else 0],
                    host.positions[known[r]] + j,
                    True,
                    [group[rows[r]] for group in host.block_ids],
                )
                for r in active
            ]
            step = HostBatch.from_scheduled(one_token_each, len(host.block_ids))
            input_ids = None if previous is None else previous[active]
            tokens = forward(step, input_ids).argmax(dim=-1)
            if drafts is None:
                drafts = torch.zeros(len(rows), longest, dtype=tokens.dtype, device=tokens.device)
            drafts[active, j] = tokens
            previous = drafts[:, j]
        assert drafts is not None
        mask = torch.arange(longest) < num_drafts[:, None]
        return drafts[mask.to(drafts.device)]
