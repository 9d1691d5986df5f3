"""A step's inputs, built on the device from the persistent request state.

The host sends the step's schedule: per request (decodes first) its row, its tokens this step and
how many it has in the KV cache (`StepSchedule`, a few numpy arrays, one copy). Everything else is
gathered on the device from the rows (vllm/v1/worker/gpu/input_batch.py: prepare_inputs and
compute_slot_mappings; here one Triton kernel on CUDA, pagedkv/kernels/prepare_inputs.py, and a
handful of torch ops on the CPU):

    schedule    rows [3, 0, 7]   query_lens [1, 1, 3]   num_computed [5, 2, 0]
    host        query_start_loc [0, 1, 2, 5]   seq_lens [6, 3, 3]   (the builders read these too)
    device      token -> request  [0, 1, 2, 2, 2]       (searchsorted in query_start_loc)
                positions         [5, 2, 0, 1, 2]       (num_computed + index in the request)
                input_ids         token_ids[row, position]
                slot_mapping[g]   block_tables[g][row, position // B] * B + position % B
                block_table[g]    block_tables[g][rows]  (only the columns any row has used)

Padding for a CUDA graph: tokens past the step's are id 0 at position 0 with slot -1 (nothing
written), requests past its are the state's padding row with query length 0 and sequence length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.worker.input_batch import InputBatch, compute_slot_mapping
from pagedkv.worker.states import RequestStates, to_device


@dataclass
class StepSchedule:
    """One step as the runner reads it: per request, in batch order, its row and token counts."""

    req_ids: list[str]
    rows: np.ndarray
    """[requests] int32: each request's row of the persistent state (MRV2's idx_mapping)."""
    query_lens: np.ndarray
    """[requests] int32: its tokens this step (last known token + drafts, or a prompt chunk)."""
    num_computed: np.ndarray
    """[requests] int32: its tokens already in the KV cache."""
    num_draft_tokens: np.ndarray
    """[requests] int32: speculative decoding, the last this-many of its query tokens are drafts."""
    samples: np.ndarray
    """[requests] bool: the step reaches its newest token, so its next one is sampled."""
    writes_kv_cache: bool = True
    """False for a CUDA graph capture's dummy batch: every slot is -1."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def sampling_req_ids(self) -> list[str]:
        return [r for r, s in zip(self.req_ids, self.samples.tolist()) if s]

    def logits_indices(self) -> np.ndarray:
        """Packed index of each token whose next token is sampled or verified: per sampling request,
        the token before each of its drafts and its last token (1 + drafts rows)."""
        ends = np.cumsum(self.query_lens)
        counts = np.where(self.samples, 1 + self.num_draft_tokens, 0)
        firsts = ends - 1 - self.num_draft_tokens
        return _ranges(firsts, counts)

    def draft_indices(self) -> np.ndarray:
        """Packed index of every draft token, request after request."""
        ends = np.cumsum(self.query_lens)
        return _ranges(ends - self.num_draft_tokens, self.num_draft_tokens)

    @classmethod
    def for_capture(cls, query_lens: list[int], padding_row: int) -> StepSchedule:
        """A dummy batch of these query lengths for a CUDA graph capture: every request reads the
        padding row (token id 0, the null block), nothing is written, nothing sampled."""
        n = len(query_lens)
        zeros = np.zeros(n, dtype=np.int32)
        return cls(
            [f"<capture {i}>" for i in range(n)],
            np.full(n, padding_row, dtype=np.int32),
            np.asarray(query_lens, dtype=np.int32),
            zeros,
            zeros,
            np.zeros(n, dtype=bool),
            writes_kv_cache=False,
        )


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges [start, start + count) without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    ranges: np.ndarray = (np.repeat(starts, counts) + np.arange(total) - offsets).astype(np.int64)
    return ranges


@dataclass
class StepBuffers:
    """The step inputs' persistent device tensors, allocated once at their largest size: a CUDA graph
    captured on views of their first rows reads each step's values there."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mappings: list[torch.Tensor]
    block_tables: list[torch.Tensor]
    """Per KV cache group [max requests, max blocks]: columns no row has used stay 0."""

    @classmethod
    def allocate(
        cls, max_num_tokens: int, max_num_reqs: int, max_blocks: list[int], device: torch.device
    ) -> StepBuffers:
        return cls(
            input_ids=torch.zeros(max_num_tokens, dtype=torch.long, device=device),
            positions=torch.zeros(max_num_tokens, dtype=torch.long, device=device),
            query_start_loc=torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
            slot_mappings=[torch.full((max_num_tokens,), -1, dtype=torch.long, device=device) for _ in max_blocks],
            block_tables=[torch.zeros(max_num_reqs, w, dtype=torch.int32, device=device) for w in max_blocks],
        )


def prepare_inputs(
    states: RequestStates,
    schedule: StepSchedule,
    buffers: StepBuffers | None,
    block_sizes: list[int],
    num_padded_tokens: int | None = None,
    num_padded_reqs: int | None = None,
    use_kernels: bool | None = None,
) -> InputBatch:
    """The step's InputBatch in the first rows of `buffers` (the persistent ones CUDA graphs read),
    padded for a graph when asked; without them, in fresh tensors of the step's size. Token ids,
    positions and slots come from a Triton kernel, one launch per KV cache group (`use_kernels`, default:
    on CUDA), or torch ops."""
    n, num_tokens = len(schedule.req_ids), schedule.num_tokens
    n_pad, t_pad = num_padded_reqs or n, num_padded_tokens or num_tokens
    if buffers is None:
        widths = [table.shape[1] for table in states.block_tables]
        buffers = StepBuffers.allocate(t_pad, n_pad, widths, states.token_ids.device)
    device = buffers.input_ids.device
    qsl_cpu = np.full(n_pad + 1, num_tokens, dtype=np.int32)
    qsl_cpu[0] = 0
    np.cumsum(schedule.query_lens, out=qsl_cpu[1 : n + 1])
    seq_lens_cpu = np.zeros(n_pad, dtype=np.int32)
    seq_lens_cpu[:n] = schedule.num_computed + schedule.query_lens
    rows = np.full(n_pad, states.padding_row, dtype=np.int32)
    rows[:n] = schedule.rows
    logits_indices, draft_indices = schedule.logits_indices(), schedule.draft_indices()
    # One host-to-device copy for everything the host knows.
    parts = (rows, qsl_cpu, seq_lens_cpu, logits_indices, draft_indices)
    packed = to_device(np.concatenate(parts).astype(np.int32), device).long()
    rows_d, qsl_d, seq_lens_d, logits_d, drafts_d = torch.split(packed, [len(p) for p in parts])

    query_start_loc = buffers.query_start_loc[: n_pad + 1]
    query_start_loc.copy_(qsl_d)
    seq_lens = buffers.seq_lens[:n_pad]
    seq_lens.copy_(seq_lens_d)
    input_ids, positions = buffers.input_ids[:t_pad], buffers.positions[:t_pad]
    slot_mappings = [buffers.slot_mappings[g][:t_pad] for g in range(len(block_sizes))]
    if use_kernels if use_kernels is not None else device.type == "cuda":
        # Imported here: importing triton must wait for a notebook's TRITON_INTERPRET (kernels/common.py).
        from pagedkv.kernels import prepare_inputs as kernels

        kernels.prepare_inputs(
            rows_d[:n],
            qsl_d[: n + 1],
            seq_lens_d[:n],
            states.token_ids,
            input_ids,
            positions,
            states.block_tables,
            block_sizes,
            slot_mappings if schedule.writes_kv_cache else None,
        )
    else:
        token_index = torch.arange(num_tokens, device=device)
        request = torch.searchsorted(qsl_d[1 : n + 1], token_index, right=True)
        # num_computed + index in the request = seq_len - query_len + (token - start) = seq_len - end + token
        pos = seq_lens_d[request] - qsl_d[request + 1] + token_index
        token_rows = rows_d[request]
        input_ids[:num_tokens] = states.token_ids[token_rows, pos]
        positions[:num_tokens] = pos
        for g, block_size in enumerate(block_sizes):
            if schedule.writes_kv_cache:
                slot_mappings[g][:num_tokens] = compute_slot_mapping(
                    states.block_tables[g], token_rows, pos, block_size
                )
    input_ids[num_tokens:] = 0
    positions[num_tokens:] = 0
    block_tables = []
    for g, slots in enumerate(slot_mappings):
        slots[num_tokens if schedule.writes_kv_cache else 0 :] = -1  # padding (or a capture): nothing written
        table, cols = buffers.block_tables[g][:n_pad], states.block_columns[g]
        if cols:
            table[:, :cols] = states.block_tables[g][rows_d, :cols]
        block_tables.append(table)
    return InputBatch(
        req_ids=schedule.req_ids,
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        query_start_loc_cpu=torch.from_numpy(qsl_cpu),
        seq_lens=seq_lens,
        seq_lens_cpu=torch.from_numpy(seq_lens_cpu),
        num_tokens=num_tokens,
        max_query_len=int(schedule.query_lens.max(initial=0)),
        max_seq_len=int(seq_lens_cpu.max(initial=0)),
        block_tables=block_tables,
        slot_mappings=slot_mappings,
        logits_indices=logits_d,
        sampling_req_ids=schedule.sampling_req_ids,
        draft_indices=drafts_d,
    )
