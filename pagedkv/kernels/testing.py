"""Random paged batches for kernel tests, benchmarks and notebooks.

A batch here is what one engine step hands the attention kernel: packed queries of ragged
length, a paged KV cache whose blocks were handed out in random order (a permuted page table,
never the identity, so a kernel that ignores the table fails), and the metadata tensors.

`poisoned`, `poison_batch` and `run_poisoned` put such tensors into NaN-filled memory, so that
a kernel reading outside them (say, past a head of 80 values up to the padded 128) gets NaN
deterministically instead of whatever happens to be there, and one writing outside them leaves
a mark. The kernel imports are local: the batches alone need no triton.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from pagedkv.kernels.attention_config import MAX_SPLITS, KernelConfig
from pagedkv.kernels.common import next_power_of_2

if TYPE_CHECKING:
    from pagedkv.kernels.split_kv import SplitKVWorkspace


class AttentionKwargs(TypedDict):
    """`unified_attention`'s metadata keyword arguments, as `PagedBatch.attention_kwargs` gives them."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor
    softmax_scale: float


@dataclass
class PagedBatch:
    """Queries, a paged K/V cache and the metadata `unified_attention` reads."""

    q: torch.Tensor
    """[num_tokens, num_q_heads, head_size]"""
    kv_cache: torch.Tensor
    """[2, num_blocks, block_size, num_kv_heads, head_size]: K and V of one layer."""
    query_start_loc: torch.Tensor
    """int32 [num_reqs + 1]"""
    seq_lens: torch.Tensor
    """int32 [num_reqs]"""
    block_table: torch.Tensor
    """int32 [num_reqs, max_blocks]; unused entries are 0."""
    query_lens: list[int]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[1]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def attention_kwargs(self) -> AttentionKwargs:
        """The metadata keyword arguments of `unified_attention` (scale 1/sqrt(head_size))."""
        return AttentionKwargs(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            block_table=self.block_table,
            softmax_scale=self.q.shape[2] ** -0.5,
        )

    def query_slots(self) -> torch.Tensor:
        """int64 [num_tokens]: the cache slot of every query token (where its new K/V go)."""
        slots = []
        for r, (query_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens.tolist())):
            pos = torch.arange(seq_len - query_len, seq_len, device=self.block_table.device)
            blocks = self.block_table[r, pos // self.block_size].long()
            slots.append(blocks * self.block_size + pos % self.block_size)
        return torch.cat(slots)


def random_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Request i has `context_lens[i]` cached tokens and `query_lens[i]` new ones (its last)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req + [0]) + 1, dtype=torch.int32, device=device)
    taken = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = order[taken : taken + n]
        taken += n
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    q = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen, device=device).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(
        q=q,
        kv_cache=kv_cache,
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        query_lens=list(query_lens),
    )


def poisoned(tensor: torch.Tensor, gap: int, tail: int = 0, fill: float = float("nan")) -> torch.Tensor:
    """A copy of `tensor` surrounded by `fill`: a strided view into a larger `fill`-ed buffer.

    Every row of the last dimension is preceded by `gap` fill values, and `tail` more follow the
    last row (with `tail=0` the copy ends exactly where the buffer ends). A kernel that reads up
    to `gap` values past a row therefore reads `fill`, and past the last row it reads the tail
    or leaves the allocation. Give a tensor that a kernel writes a tail: a stray store then
    lands in it (see `outside`) rather than in the heap.
    """
    *outer, last = tensor.shape
    rows = math.prod(outer) * (gap + last)
    buffer = torch.full((rows + tail,), fill, dtype=tensor.dtype, device=tensor.device)
    view = buffer[:rows].view(*outer, gap + last)[..., gap:]
    view.copy_(tensor)
    return view


def outside(view: torch.Tensor) -> torch.Tensor:
    """The values of `view`'s whole storage that `view` does not cover, flattened.

    For a `poisoned` tensor these stay the fill value as long as nothing wrote outside the view.
    """
    storage = torch.empty(0, dtype=view.dtype, device=view.device).set_(view.untyped_storage())
    covered = torch.zeros(storage.shape, dtype=torch.bool, device=view.device)
    covered.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
    return storage[~covered]


def poison_batch(batch: PagedBatch, gap: int) -> PagedBatch:
    """The same batch, with NaN wherever a kernel has no business reading.

    q and the KV cache become `poisoned` copies (NaN between heads and tokens, the cache at the
    very end of its buffer). The cache slots past each sequence's end in its last block and
    the blocks no request owns hold NaN, and every block-table entry past a request's last
    block points at an unowned block. A correct kernel gives the same output as on `batch`;
    one that reads a padded head dimension, a key past the sequence or an unused page-table
    entry mixes NaN into its scores or values (0 x NaN is NaN).
    """
    block_size = batch.block_size
    kv_cache = batch.kv_cache.clone()
    block_table = batch.block_table.clone()
    owned = torch.zeros(kv_cache.shape[1], dtype=torch.bool, device=kv_cache.device)
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        num_blocks = -(-seq_len // block_size)
        owned[block_table[r, :num_blocks].long()] = True
        if num_blocks > 0:
            kv_cache[:, block_table[r, num_blocks - 1], seq_len - (num_blocks - 1) * block_size :] = float("nan")
    unowned = (~owned).nonzero().flatten()
    if unowned.numel() == 0:
        raise ValueError("poison_batch needs a cache block that no request owns (random_paged_batch leaves 3)")
    kv_cache[:, unowned] = float("nan")
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        block_table[r, -(-seq_len // block_size) :] = unowned[r % unowned.numel()].to(block_table.dtype)
    return dataclasses.replace(
        batch, q=poisoned(batch.q, gap), kv_cache=poisoned(kv_cache, gap), block_table=block_table
    )


def overread_gap(head_size: int) -> int:
    """NaN values to put between rows: more than a tile padded to a power of two reads past a head."""
    return next_power_of_2(head_size) - head_size + 8


def poisoned_workspace(
    rows: int, num_q_heads: int, head_size: int, gap: int, device: torch.device | str
) -> SplitKVWorkspace:
    """A split-KV workspace of exactly `rows` rows whose scratch starts as NaN, `poisoned` by `gap`.

    The merge must read only the partial results the attention kernel wrote.
    """
    from pagedkv.kernels.split_kv import SplitKVWorkspace

    workspace = SplitKVWorkspace(rows, num_q_heads, head_size, device)
    workspace.partial_out = poisoned(workspace.partial_out.fill_(float("nan")), gap, tail=gap)
    workspace.partial_lse.fill_(float("nan"))
    return workspace


def run_poisoned(
    batch: PagedBatch, sliding_window: int | None = None, config: KernelConfig | None = None
) -> tuple[torch.Tensor, int]:
    """`unified_attention` on `poison_batch(batch)`, into a poisoned NaN-filled output.

    The split-KV partials go to a `poisoned_workspace`: exactly `num_tokens * num_splits` rows
    when `config` fixes the splits, room for the most splits otherwise. Returns the output
    (NaN wherever the kernel read poison or wrote nothing) and the number of values around
    the output and the workspace that are no longer NaN (stray writes; 0 for a sound kernel).
    """
    from pagedkv.kernels.unified_attention import unified_attention

    num_tokens, num_q_heads, head_size = batch.q.shape
    gap = overread_gap(head_size)
    bad = poison_batch(batch, gap)
    out = poisoned(torch.full_like(batch.q, float("nan")), gap, tail=gap)
    rows = num_tokens * (MAX_SPLITS if config is None else config.num_splits)
    workspace = poisoned_workspace(rows, num_q_heads, head_size, gap, batch.q.device)
    unified_attention(
        bad.q,
        bad.k_cache,
        bad.v_cache,
        out,
        **bad.attention_kwargs(),
        sliding_window=sliding_window,
        workspace=workspace,
        config=config,
    )
    stray = sum(int((~outside(t).isnan()).sum()) for t in (out, workspace.partial_out))
    return out, stray
