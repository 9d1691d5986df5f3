"""The draft model of speculative decoding: a smaller model in the same runner proposes k tokens.

It is built beside the target with the layer prefix "draft.model", so its attention layers sit in
the same static forward context under their own names, get their own KV cache spec (a KV cache
group of their own when their shapes differ) and their own attention group (another backend or
query-head count). Each step it does two things (after vllm/v1/spec_decode/draft_model.py):

    1. propose, before the target runs: for every decoding request with drafts to fill, k greedy
       forwards of one token each, from its last known token t at position P, each draft written
       into the request's row (pagedkv/worker/states.py), where the next forward and then the
       target's inputs read it:
           forward(t @ P) -> d1,  forward(d1 @ P+1) -> d2,  ...,  forward(d(k-1) @ P+k-1) -> dk
    2. catch up, after the target ran: one forward over the target's own batch (prompt chunks,
       [t d1 .. dk]), in the same forward context, so the draft's KV cache holds every token the
       target computed. Accepted drafts' K/V are then right; rejected ones are written again.

Drafts are argmax tokens (a one-hot draft distribution): rejection sampling with one-hot drafts
keeps the target's distribution exactly (pagedkv/engine/rejection_sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedkv.config import EngineConfig
from pagedkv.models.loader import CausalLM, load_config, load_model
from pagedkv.worker.prepare_inputs import StepSchedule
from pagedkv.worker.states import RequestStates, to_device

DRAFT_PREFIX = "draft.model"
"""Where the draft model's layers register (`draft.model.layers.0.self_attn.attn`, ...)."""

DraftForward = Callable[[StepSchedule], torch.Tensor]
"""The runner's draft forward: gather a batch from the request rows, run the draft model in a
forward context of its own, return the logits at the batch's logits_indices."""


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

    @torch.inference_mode()
    def propose(self, states: RequestStates, schedule: StepSchedule, forward: DraftForward) -> None:
        """The drafts of every request of `schedule` that has some, written into its row of `states`
        at their positions (where the target's inputs are gathered from)."""
        has = schedule.num_draft_tokens > 0
        req_ids = [r for r, h in zip(schedule.req_ids, has.tolist()) if h]
        rows, num_drafts = schedule.rows[has], schedule.num_draft_tokens[has]
        # Each one's last known token: the first input; its drafts follow it.
        last = (schedule.num_computed + schedule.query_lens)[has] - num_drafts - 1
        device = states.token_ids.device
        for j in range(int(num_drafts.max())):
            active = num_drafts > j
            n = int(active.sum())
            step = StepSchedule(
                [r for r, a in zip(req_ids, active.tolist()) if a],
                rows[active],
                np.ones(n, dtype=np.int32),
                last[active] + j,
                np.zeros(n, dtype=np.int32),
                np.ones(n, dtype=bool),
            )
            tokens = forward(step).argmax(dim=-1)
            where = to_device(np.stack([rows[active], last[active] + j + 1]).astype(np.int64), device)
            states.write_sampled(where[0], where[1], tokens)
