"""Persistent request state: each running request owns a row of device tensors until it ends.

Model Runner V2 keeps what it knows of a request apart from any one step's inputs
(vllm/v1/worker/gpu/states.py, vllm/v1/worker/gpu/block_table.py): a request gets a row when it is
admitted and gives it back when it finishes or is preempted. A step then only says which rows run
and how many tokens each; its inputs are gathered from the rows on the device
(pagedkv/worker/prepare_inputs.py).

    row r    token_ids[r, p]         token at position p: prompt, outputs, drafts
             block_tables[g][r, c]   per KV cache group, its c-th physical block (0 = the null block)
             sampling[:, r]          temperature, top-k, top-p, min-p (+ seeds[r]): device copies the
                                     sampler gathers, host copies for its summaries
    row R    (one past the last)     all zeros, never owned: what a graph's padding requests read

What the host learns between steps (a prompt chunk, a block, an n-gram draft) is staged as (flat
index, value) pairs (`StagedWrites`, after MRV2's `StagedWriteTensor`,
vllm/v1/worker/gpu/buffer_utils.py), packed into one array, copied once, and scattered on the device,
one scatter per tensor (`RequestStates.apply`). Tokens sampled on the device are
scattered into their rows on the device (`write_sampled`): under async scheduling they never pass
through the host on their way to the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.worker.sampling_metadata import SamplingMetadata


@dataclass(frozen=True)
class RowSamplingParams:
    """A request's sampling parameters as plain values: what its row holds (the worker layer does
    not know the engine's SamplingParams)."""

    temperature: float = 0.0
    """0.0: greedy (the engine stores 0.0 for any temperature it samples greedily)."""
    top_k: int = 0
    """0: no top-k (the engine stores 0 for a top-k of the vocabulary or more)."""
    top_p: float = 1.0
    """1.0: no top-p."""
    min_p: float = 0.0
    """0.0: no min-p."""
    seed: int = 0
    """The key of the request's noise, an int64 (an unseeded request's comes from the engine seed)."""
    num_logprobs: int = -1
    """-1: no logprobs; N: the N most likely tokens' logprobs of each sampled row."""


def to_device(
    values: np.ndarray | list[int] | list[float], device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Host values on the device without waiting for the GPU: `torch.tensor(values, device=...)` would
    wait for everything queued there (the forward just launched) before copying. Copied from pinned
    memory (torch's caching host allocator makes pinning cheap after the first steps)."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        tensor = tensor.to(dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class StagedWrites:
    """(flat index, value) pairs for one tensor, gathered on the host until `RequestStates.apply`."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        # Python lists: most stagings are a token or a block, where a numpy array each costs more.
        self.index: list[int] = []
        self.values: list[int] = []

    def stage(self, start: int, values: list[int]) -> None:
        """Write `values` at flat positions start, start + 1, ... of the target."""
        self.index.extend(range(start, start + len(values)))
        self.values.extend(values)

    def discard(self) -> None:
        self.index, self.values = [], []


class RequestStates:
    """Every request the runner holds, one row each, on the device; the host keeps only what the
    next diff needs (each row's block ids) and the sampling parameters' host copies."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks: list[int], device: torch.device) -> None:
        rows = max_num_reqs + 1
        self.padding_row = max_num_reqs
        """The row padding requests read: zeros everywhere, never owned."""
        self.token_ids = torch.zeros(rows, max_model_len, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(rows, width, dtype=torch.int32, device=device) for width in max_blocks]
        self.sampling = torch.zeros(4, rows, dtype=torch.float32, device=device)
        """Per row: temperature, top-k, top-p, min-p (top-k < 2**24, exact in float32)."""
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampling_host = np.zeros((4, rows), dtype=np.float32)
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        """Request id -> its row."""
        self._free = list(range(max_num_reqs - 1, -1, -1))  # popped from the end: row 0 first
        self._block_ids: list[list[list[int]]] = [[[] for _ in range(rows)] for _ in max_blocks]
        """Per group and row, the block ids its device row holds: what the next diff compares to."""
        self.token_writes = StagedWrites(self.token_ids)
        """Token ids at flat positions row * max_model_len + position."""
        self._block_writes = [StagedWrites(t) for t in self.block_tables]
        self._seed_writes = StagedWrites(self.seeds)
        self._writes = [self.token_writes, *self._block_writes, self._seed_writes]
        self._admitted: list[int] = []
        """Rows added since the last `apply`: their sampling parameters go over with it."""
        self._pending_rows: list[tuple[int, int, list[int]]] = []
        """(group, row, block ids) staged: the host copy of the row once `apply` has run."""
        self.block_columns = [0] * len(max_blocks)
        """Per group, the columns any row has used: a step gathers only these."""

    def remove(self, req_ids: list[str]) -> None:
        """Give the rows of these requests back (finished, aborted or preempted; unknown ids pass)."""
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self._free.append(row)

    def add(self, req_id: str, params: RowSamplingParams) -> int:
        """A row for a request seen for the first time: its sampling parameters staged, no blocks."""
        if not self._free:
            raise RuntimeError(
                f"No free request row for {req_id!r}: all {len(self.row_of)} are held "
                "(a finished request's row was not given back: an engine bug)."
            )
        row = self._free.pop()
        self.row_of[req_id] = row
        self.sampling_host[:, row] = (params.temperature, params.top_k, params.top_p, params.min_p)
        self.num_logprobs[row] = params.num_logprobs
        self._seed_writes.stage(row, [params.seed])
        self._admitted.append(row)
        # Its block rows keep the last owner's ids, on the device and in `_block_ids` alike: the
        # first `stage_blocks` overwrites what differs and zeroes the rest (unused entries stay 0).
        return row

    def stage_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Known token ids at positions start, start + 1, ... of the row."""
        self.token_writes.stage(row * self.token_ids.shape[1] + start, token_ids)

    def stage_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """The row's block ids per KV cache group as the KV cache manager holds them now: only what
        changed is staged (blocks appended; a tail given back and refilled; a sliding window's freed
        front, now the null block). Usually nothing: one list compare, in C."""
        for g, (ids, held) in enumerate(zip(block_ids, self._block_ids)):
            old = held[row]
            if ids == old:
                continue
            width = self.block_tables[g].shape[1]
            if len(ids) > width:
                raise ValueError(f"A request holds {len(ids)} blocks; the block table has room for {width}.")
            first = 0
            while first < min(len(ids), len(old)) and ids[first] == old[first]:
                first += 1
            # Past the new end, zeros (the null block) where the old row was longer.
            self._block_writes[g].stage(row * width + first, [*ids[first:], *[0] * (len(old) - len(ids))])
            self._pending_rows.append((g, row, list(ids)))

    def apply(self) -> None:
        """Everything staged since the last call, on the device, in one copy: every tensor's (index,
        value) pairs packed into one int64 array, then one scatter per tensor; rows admitted since
        bring their sampling parameters (one more copy). The host's copies of the rows follow."""
        writes = [w for w in self._writes if w.index]
        if writes:
            flat: list[int] = []
            for w in writes:
                flat += w.index
                flat += w.values
            packed = to_device(np.array(flat, dtype=np.int64), self.token_ids.device)
            for w, pairs in zip(writes, packed.split([2 * len(w.index) for w in writes])):
                index, values = pairs.split(len(w.index))
                w.target.view(-1).index_copy_(0, index, values.to(w.target.dtype))
                w.discard()
        if self._admitted:
            rows = np.array(self._admitted, dtype=np.int64)
            index = to_device(rows, self.sampling.device)
            self.sampling[:, index] = to_device(np.ascontiguousarray(self.sampling_host[:, rows]), self.sampling.device)
            self._admitted = []
        for g, row, ids in self._pending_rows:
            self._block_ids[g][row] = ids
            self.block_columns[g] = max(self.block_columns[g], len(ids))
        self._pending_rows = []

    def discard(self) -> None:
        """Forget everything staged since the last `apply` (a step that failed while staging)."""
        for writes in self._writes:
            writes.discard()
        self._pending_rows, self._admitted = [], []

    def write_sampled(self, rows: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Tokens made on the device (sampled, drafted) into their rows at their positions."""
        self.token_ids[rows, positions] = token_ids.to(self.token_ids.dtype)

    def sampling_metadata(self, rows: np.ndarray, positions: torch.Tensor) -> SamplingMetadata:
        """The sampler's inputs for logits rows of these request rows (a request's 1 + k rows under
        speculative decoding repeat its row), `positions` the token each draws: gathered on the
        device; the summaries from the host copies, so nothing waits for the device."""
        index = to_device(rows.astype(np.int64), self.seeds.device)
        return SamplingMetadata.from_rows(
            self.sampling[:, index], self.sampling_host[:, rows], self.num_logprobs[rows], self.seeds[index], positions
        )
