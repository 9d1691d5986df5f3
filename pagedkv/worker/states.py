"""Persistent request state: each running request owns a row of device tensors until it ends.

Model Runner V2 keeps what it knows of a request apart from any one step's inputs
(vllm/v1/worker/gpu/states.py, vllm/v1/worker/gpu/block_table.py): a request gets a row when it is
admitted and gives it back when it finishes or is preempted. A step then only says which rows run
and how many tokens each; its inputs are gathered from the rows on the device
(pagedkv/worker/prepare_inputs.py).

    row r    token_ids[r, p]         token at position p: prompt, outputs, drafts
             block_tables[g][r, c]   per KV cache group, its c-th physical block (0 = the null block)
             sampling[:, r]          temperature, top-k, top-p, min-p, presence, frequency and
                                     repetition penalties, prompt length (+ seeds[r]): device copies
                                     the sampler gathers, host copies for its summaries
             adjustments[r]          (host) its logit_bias and min_tokens entries: (token, value, until)
    row R    (one past the last)     all zeros, never owned: what a graph's padding requests read

What the host learns between steps (a prompt chunk, a block, an n-gram draft) is staged as (flat
index, value) pairs (`StagedWrites`, after MRV2's `StagedWriteTensor`,
vllm/v1/worker/gpu/buffer_utils.py), packed into one array, copied once, and scattered on the device,
one scatter per tensor (`RequestStates.apply`). Tokens sampled on the device are
scattered into their rows on the device (`write_sampled`): under async scheduling they never pass
through the host on their way to the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv.worker.sampling_metadata import LogitAdjustments, PenaltyInputs, SamplingMetadata

NO_LIMIT = 2**62
"""The `until` position of an adjustment that always holds (a logit bias): past any sequence."""

Adjustments = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A row's logit adjustments: token ids (int64), values (float32), until (int64), one entry each."""
_NO_ADJUSTMENTS: Adjustments = (np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64))


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
    presence_penalty: float = 0.0
    """Subtracted from the logit of each token the output holds (0.0: none)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it (0.0: none)."""
    repetition_penalty: float = 1.0
    """Divides a positive logit, multiplies a negative one, of each token of the prompt or output (1.0: none)."""
    num_prompt_tokens: int = 0
    """Where the output starts in the row: the penalties tell prompt tokens from output tokens by it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits of every step."""
    min_tokens: int = 0
    """Until the output holds this many tokens, `min_tokens_stop_ids` cannot be drawn."""
    min_tokens_stop_ids: tuple[int, ...] = ()
    """The ids that would end the request (end-of-sequence unless ignored, stop token ids)."""
    token_ids: Sequence[int] = field(default=(), compare=False, repr=False)
    """A request with a penalty: its tokens (prompt, then output), read when it gets a row for those the
    KV cache holds already (a prefix-cache hit), which no schedule sends but its penalties count. The
    engine's own growing list, read only up to the cached count; empty for a request without penalties."""

    def __getstate__(self) -> dict[str, object]:
        """Pickled (sent to the worker ranks of tensor parallelism with every step's schedule) without
        `token_ids`: only rank 0 samples, and the list would be the whole sequence, every step."""
        return {**self.__dict__, "token_ids": ()}

    @property
    def penalized(self) -> bool:
        """Whether a penalty counts the row's tokens (the sampler then gathers its history)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def adjustments(self) -> Adjustments:
        """(token ids, values, until): what the row adds to its logits while the position it draws is
        below `until`: each logit bias always, -inf on each stop id until the output has min_tokens."""
        masked = self.min_tokens_stop_ids if self.min_tokens > 0 else ()
        until = self.num_prompt_tokens + self.min_tokens
        return (
            np.array([t for t, _ in self.logit_bias] + list(masked), dtype=np.int64),
            np.array([b for _, b in self.logit_bias] + [float("-inf")] * len(masked), dtype=np.float32),
            np.array([NO_LIMIT] * len(self.logit_bias) + [until] * len(masked), dtype=np.int64),
        )


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
        self.sampling = torch.zeros(8, rows, dtype=torch.float32, device=device)
        """Per row: temperature, top-k, top-p, min-p, presence, frequency and repetition penalties, and
        the prompt's length (top-k and lengths < 2**24, exact in float32): one copy when rows are admitted."""
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampling_host = np.zeros((8, rows), dtype=np.float32)
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)
        self.penalized = np.zeros(rows, dtype=bool)
        """Per row (host): a penalty counts its tokens."""
        self.adjusted = np.zeros(rows, dtype=bool)
        """Per row (host): it has logit_bias / min_tokens entries."""
        self.adjustments: list[Adjustments] = [_NO_ADJUSTMENTS] * rows
        """Per row (host): its logit_bias / min_tokens entries (`RowSamplingParams.adjustments`). Sparse:
        a step gathers its rows' entries into one list, which the sampler adds with one index_put."""
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

    def remove(self, req_ids: Sequence[str]) -> None:
        """Give the rows of these requests back (finished, aborted or preempted; unknown ids pass)."""
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self._free.append(row)

    def add(self, req_id: str, params: RowSamplingParams, num_cached_tokens: int = 0) -> int:
        """A row for a request seen for the first time: its sampling parameters staged, no blocks.
        A penalized request's first `num_cached_tokens` tokens (a prefix-cache hit, never scheduled)
        are staged too: its penalties count them."""
        if not self._free:
            raise RuntimeError(
                f"No free request row for {req_id!r}: all {len(self.row_of)} are held "
                "(a finished request's row was not given back: an engine bug)."
            )
        row = self._free.pop()
        self.row_of[req_id] = row
        p = params
        self.sampling_host[:, row] = (
            p.temperature, p.top_k, p.top_p, p.min_p,
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.num_prompt_tokens,
        )  # fmt: skip
        self.num_logprobs[row] = p.num_logprobs
        self.penalized[row] = p.penalized
        self.adjusted[row] = bool(p.logit_bias) or bool(p.min_tokens and p.min_tokens_stop_ids)
        self.adjustments[row] = p.adjustments() if self.adjusted[row] else _NO_ADJUSTMENTS
        self._seed_writes.stage(row, [p.seed])
        if p.penalized and num_cached_tokens:
            self.stage_tokens(row, 0, list(p.token_ids[:num_cached_tokens]))
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
            for w, pairs in zip(writes, torch.split(packed, [2 * len(w.index) for w in writes])):
                index, values = torch.split(pairs, len(w.index))
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

    def sampling_metadata(
        self, rows: np.ndarray, positions: torch.Tensor, max_seq_len: int | None = None
    ) -> SamplingMetadata:
        """The sampler's inputs for logits rows of these request rows (a request's 1 + k rows under
        speculative decoding repeat its row), `positions` the token each draws (all below
        `max_seq_len` + 1, when given): gathered on the device; the summaries from the host copies, so
        nothing waits for the device. Penalties and logit adjustments only where a row has them."""
        index = to_device(rows.astype(np.int64), self.seeds.device)
        meta = SamplingMetadata.from_rows(
            self.sampling[:4, index],
            self.sampling_host[:4, rows],
            self.num_logprobs[rows],
            self.seeds[index],
            positions,
        )
        penalized = np.flatnonzero(self.penalized[rows])
        if len(penalized):
            meta.penalties = self._penalty_inputs(index, penalized, positions, max_seq_len)
        adjusted = np.flatnonzero(self.adjusted[rows])
        if len(adjusted):
            meta.adjustments = self._logit_adjustments([(int(i), self.adjustments[rows[i]]) for i in adjusted])
        return meta

    def _penalty_inputs(
        self, index: torch.Tensor, penalized: np.ndarray, positions: torch.Tensor, max_seq_len: int | None
    ) -> PenaltyInputs:
        """The penalized logits rows' token history, copied now: a row's tokens before the position it
        draws are exactly what the model saw (under speculative decoding the row's own drafts before
        it; under async scheduling the previous step's token, scattered in before the forward)."""
        which = to_device(penalized, index.device)
        rows = index[which]
        width = self.token_ids.shape[1] if max_seq_len is None else min(max_seq_len, self.token_ids.shape[1])
        return PenaltyInputs(
            rows=which,
            token_ids=self.token_ids[rows, :width],
            positions=positions[which],
            num_prompt_tokens=self.sampling[7, rows].long(),
            presence=self.sampling[4, rows],
            frequency=self.sampling[5, rows],
            repetition=self.sampling[6, rows],
        )

    def _logit_adjustments(self, adjusted: list[tuple[int, Adjustments]]) -> LogitAdjustments:
        """The adjusted rows' (logits row, token, value, until) entries, packed into one list: two copies."""
        logit_rows = np.concatenate([np.full(len(a[0]), i, dtype=np.int64) for i, a in adjusted])
        ints = np.stack([logit_rows, *(np.concatenate([a[k] for _, a in adjusted]) for k in (0, 2))])
        values = np.concatenate([a[1] for _, a in adjusted])
        rows, token_ids, until = to_device(ints, self.seeds.device)
        return LogitAdjustments(rows, token_ids, to_device(values, self.seeds.device), until)
