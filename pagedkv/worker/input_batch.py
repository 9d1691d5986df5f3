"""One step's input tensors: packed tokens, positions, lengths, block tables, slot mappings.

What the runner gets from the scheduler (`ScheduledTokens`), and what it builds from it on the
device (`InputBatch`, pagedkv/worker/prepare_inputs.py), in this layout:

Three requests, decodes first, block_size 4:

    request        A (decode)   B (decode)   C (prefill chunk)
    context_len        5            2             0
    query_len          1            1             3
    tokens         [a5]         [b2]         [c0 c1 c2]        input_ids / positions packed
    query_start_loc  0            1            2           5
    seq_lens         6            3            3

    block_table row A = [3, 8]      position 5 -> block 8, offset 1 -> slot 8*4+1 = 33
    slot_mapping = [33, 2*4+2, 5*4+0, 5*4+1, 5*4+2, -1, -1]   (-1: padding tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.worker.states import RowSamplingParams


def compute_slot_mapping(
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_padded_tokens: int | None = None,
) -> torch.Tensor:
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size; pads are -1."""
    block_numbers = block_table[req_indices, positions // block_size].long()
    slots = block_numbers * block_size + positions % block_size
    if num_padded_tokens is not None and num_padded_tokens > slots.shape[0]:
        pad = torch.full((num_padded_tokens - slots.shape[0],), -1, dtype=slots.dtype, device=slots.device)
        slots = torch.cat([slots, pad])
    return slots


PLACEHOLDER_TOKEN_ID = -1
"""A scheduled token whose id the host does not know yet (async scheduling): the previous step
sampled it on the device, and the runner copies it from there into the step's input ids."""


@dataclass(slots=True)
class ScheduledTokens:
    """One request's part of a step, as the runner needs it: which new tokens, after how many cached.

    The engine's scheduler plans steps with its own request objects; the runner (a lower layer,
    and on other tensor-parallel ranks another process) gets only these plain values. Made anew for
    every request every step, and never changed after: not `frozen`, whose __init__ costs ~3x more.
    """

    req_id: str
    token_ids: list[int]
    """The tokens to run: positions `num_computed_tokens` ... `num_computed_tokens + len - 1`
    (the last may be PLACEHOLDER_TOKEN_ID)."""
    num_computed_tokens: int
    """Tokens already in the KV cache (the request's context_len this step)."""
    samples: bool
    """The last of these tokens is the request's newest: the step samples its next one."""
    block_ids: list[list[int]]
    """Per KV cache group, the request's block table row after the scheduler's allocation for this
    step: physical block ids, 0 = the null block (vLLM sends them in SchedulerOutput too)."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last this-many `token_ids` are drafts to verify (PLACEHOLDER_TOKEN_ID
    where the runner's draft model proposes them). The step returns logits for each of them and for
    the token before them: 1 + num_draft_tokens rows."""
    sampling: RowSamplingParams = RowSamplingParams()
    """Its sampling parameters: read when the request gets its row (they never change)."""
    num_prompt_logits: int = 0
    """Prompt logprobs (SamplingParams.prompt_logprobs): the first this-many `token_ids` are prompt positions
    whose next token is a prompt token too; the step returns their logits as well (`StepResult.prompt_logits`)."""


@dataclass
class SampledTokens:
    """The token ids one step sampled, still on the device: the next step's placeholders read them."""

    req_ids: list[str]
    """The requests of the rows, in order."""
    token_ids: torch.Tensor
    """[len(req_ids)] int64 on the device."""


@dataclass
class InputBatch:
    """Everything the model and the metadata builders read in one step."""

    req_ids: list[str]
    input_ids: torch.Tensor
    """[num_tokens] token ids of every scheduled token, request after request."""
    positions: torch.Tensor
    """[num_tokens] position of each token in its sequence."""
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_tables: list[torch.Tensor]
    """Per KV cache group: [num_reqs, max_blocks] on the device."""
    slot_mappings: list[torch.Tensor]
    """Per KV cache group: [num_tokens] flat slot of each new token."""
    logits_indices: torch.Tensor
    """Row of each token whose next token is sampled or verified (`StepSchedule.logits_indices`)."""
    sampling_req_ids: list[str]
    draft_indices: torch.Tensor
    """Row of every draft token (speculative decoding), request after request."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)
