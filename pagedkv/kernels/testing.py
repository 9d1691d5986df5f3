"""Random paged batches for kernel tests, benchmarks and notebooks.

A batch here is what one engine step hands the attention kernel: packed queries of ragged
length, a paged KV cache whose blocks were handed out in random order (a permuted page table,
never the identity, so a kernel that ignores the table fails), and the metadata tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def attention_kwargs(self) -> dict[str, object]:
        """The metadata keyword arguments of `unified_attention` (scale 1/sqrt(head_size))."""
        return dict(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
            block_table=self.block_table, softmax_scale=self.q.shape[2] ** -0.5,
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
        q=q, kv_cache=kv_cache, query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table, query_lens=list(query_lens),
    )
