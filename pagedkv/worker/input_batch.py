"""One step's input tensors: packed tokens, positions, lengths, block tables, slot mappings.

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

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


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


class BlockTable:
    """Per KV cache group: every running request's physical block ids, on the CPU and the device.

    The CPU copy is written by the runner each step; the device copy is what kernels read.
    Unused entries are 0 (the null block), so a kernel reading past a row's end stays in bounds.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.cpu = torch.zeros(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32)
        self.device_tensor = torch.zeros_like(self.cpu, device=device)
        self.num_reqs = 0
        self._written = 0
        """Columns [0, _written) have been written by some step; the rest are 0 everywhere."""

    def set_rows(self, rows: list[list[int]]) -> None:
        """Write this step's rows (one per scheduled request, in batch order) and copy them over.

        Only the columns some step has written are touched (past them every row is 0 on both
        sides): with a long max_model_len the table is thousands of blocks wide, while a step's
        requests hold a few dozen each.
        """
        width = max(map(len, rows), default=0)
        if width > self.max_num_blocks_per_req:
            raise ValueError(
                f"A request holds {width} blocks; the block table has room for {self.max_num_blocks_per_req}."
            )
        n = len(rows)
        self._written = max(self._written, width)
        self.cpu[:n, : self._written].zero_()
        if width:
            # One flat array for all rows (numpy reads the ids ~4x faster than torch.tensor reads
            # a list; a tensor per row, or a padded nested list, costs more still).
            lengths = [len(row) for row in rows]
            flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=sum(lengths))
            filled = torch.arange(width) < torch.tensor(lengths)[:, None]
            self.cpu[:n, :width][filled] = torch.from_numpy(flat)
        self.num_reqs = n
        self.device_tensor[:n, : self._written].copy_(self.cpu[:n, : self._written], non_blocking=True)

    def get_device_tensor(self) -> torch.Tensor:
        return self.device_tensor[: self.num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.cpu[: self.num_reqs]


PLACEHOLDER_TOKEN_ID = -1
"""A scheduled token whose id the host does not know yet (async scheduling): the previous step
sampled it on the device, and the runner copies it from there into the step's input ids."""


@dataclass(frozen=True)
class ScheduledTokens:
    """One request's part of a step, as the runner needs it: which new tokens, after how many cached.

    The engine's scheduler plans steps with its own request objects; the runner (a lower layer,
    and on other tensor-parallel ranks another process) gets only these plain values.
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


@dataclass
class HostBatch:
    """One step's scheduled tokens as host-side lists, request after request, before padding: what
    `ModelRunner` copies to the device as an `InputBatch` (vLLM keeps the same on its InputBatch's CPU
    tensors, vllm/v1/worker/gpu_input_batch.py)."""

    req_ids: list[str]
    token_ids: list[int]
    """Every scheduled token's id, packed; PLACEHOLDER_TOKEN_ID where the previous step's sample goes."""
    positions: list[int]
    """Each token's position in its sequence."""
    query_lens: list[int]
    """Per request, its tokens this step."""
    seq_lens: list[int]
    """Per request, its length once this step's tokens are in the KV cache."""
    block_ids: list[list[list[int]]]
    """Per KV cache group, per request: its block table row."""
    logits_indices: list[int]
    """Packed index of each token whose next token is sampled or verified: the last token of each request
    that samples, and before it the token preceding each of its drafts."""
    sampling_req_ids: list[str]
    """The requests that sample, in order (each owns 1 + its drafts of `logits_indices`)."""
    num_draft_tokens: list[int] = field(default_factory=list)
    """Per request, its drafts (the last of its query tokens); empty for a capture's dummy batch."""
    draft_indices: list[int] = field(default_factory=list)
    """Packed index of every draft token, request after request."""
    writes_kv_cache: bool = True
    """False for a CUDA graph capture's dummy batch: every slot is -1, nothing is written."""

    @classmethod
    def from_scheduled(cls, scheduled: list[ScheduledTokens], num_kv_cache_groups: int) -> HostBatch:
        """Pack the scheduler's requests: each one's new tokens after its cached ones."""
        batch = cls([], [], [], [], [], [[] for _ in range(num_kv_cache_groups)], [], [])
        for s in scheduled:
            # zip below would silently drop a group (or a row): refuse a request that does not
            # bring one block table row per KV cache group.
            if len(s.block_ids) != num_kv_cache_groups:
                raise ValueError(
                    f"Request {s.req_id!r} brings block ids for {len(s.block_ids)} KV cache groups, "
                    f"but the runner has {num_kv_cache_groups}."
                )
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            batch.req_ids.append(s.req_id)
            batch.token_ids += s.token_ids
            batch.positions += range(start, end)
            batch.query_lens.append(end - start)
            batch.seq_lens.append(end)
            for rows, row in zip(batch.block_ids, s.block_ids):
                rows.append(row)
            if s.samples:
                batch.logits_indices += range(len(batch.token_ids) - 1 - s.num_draft_tokens, len(batch.token_ids))
                batch.sampling_req_ids.append(s.req_id)
            batch.num_draft_tokens.append(s.num_draft_tokens)
            batch.draft_indices += range(len(batch.token_ids) - s.num_draft_tokens, len(batch.token_ids))
        return batch

    @classmethod
    def for_capture(cls, query_lens: list[int], num_kv_cache_groups: int) -> HostBatch:
        """A dummy batch of these query lengths for a CUDA graph capture: token id 0 everywhere,
        no blocks (kernels read the null block), nothing written to the cache, nothing sampled."""
        return cls(
            req_ids=[f"<capture {i}>" for i in range(len(query_lens))],
            token_ids=[0] * sum(query_lens),
            positions=[p for n in query_lens for p in range(n)],
            query_lens=query_lens,
            seq_lens=list(query_lens),  # its own list: the two are not one object to mutate
            block_ids=[[[] for _ in query_lens] for _ in range(num_kv_cache_groups)],
            logits_indices=[],
            sampling_req_ids=[],
            writes_kv_cache=False,
        )

    @property
    def placeholders(self) -> list[tuple[int, str]]:
        """(packed index, request) of every placeholder token: each is its request's last known token
        (the drafts after it are not the previous step's samples)."""
        ends = itertools.accumulate(self.query_lens)
        known = [end - 1 - d for end, d in zip(ends, self.num_draft_tokens or [0] * len(self.query_lens))]
        return [(i, r) for r, i in zip(self.req_ids, known) if self.token_ids[i] == PLACEHOLDER_TOKEN_ID]


@dataclass
class SampledTokens:
    """The token ids one step sampled, still on the device: the next step's placeholders read them."""

    req_ids: list[str]
    """The requests of the rows, in order."""
    token_ids: torch.Tensor
    """[len(req_ids)] int64 on the device."""


def fill_placeholders(
    input_ids: torch.Tensor, placeholders: list[tuple[int, str]], previous: SampledTokens | None
) -> None:
    """Copy the ids the previous step sampled into the placeholders (packed index, request),
    device to device: the host never waits for them."""
    if previous is None:
        raise ValueError(
            f"{len(placeholders)} scheduled token(s) are placeholders, but no previous step's "
            "samples were given (execute_model's `previous`)."
        )
    row = {req_id: i for i, req_id in enumerate(previous.req_ids)}
    missing = [r for _, r in placeholders if r not in row]
    if missing:
        raise ValueError(f"Requests {missing} have a placeholder token, but the previous step sampled none for them.")
    index = torch.tensor([i for i, _ in placeholders], dtype=torch.long)
    rows = torch.tensor([row[r] for _, r in placeholders], dtype=torch.long)
    device = input_ids.device
    input_ids[index.to(device, non_blocking=True)] = previous.token_ids[rows.to(device, non_blocking=True)]


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
    """Row of each token whose next token is sampled or verified (`HostBatch.logits_indices`)."""
    sampling_req_ids: list[str]
    draft_indices: torch.Tensor
    """Row of every draft token (speculative decoding), request after request."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)
