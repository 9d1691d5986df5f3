"""The attention benchmarks' paged batch: Llama-3-8B's attention shapes (32 query heads over 8 KV
heads of 128, bf16, blocks of 16), and the kernel config `unified_attention` would pick for a batch.

Shared by benchmarks/attention.py, compare_kernel.py and kernel_launch_overhead.py. It imports only
`choose_config` and `random_paged_batch` from pagedkv (and names the rest for type checkers alone),
so kernel_launch_overhead.py can still time an older checkout put first on PYTHONPATH.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from pagedkv.kernels.attention_config import choose_config
from pagedkv.kernels.testing import random_paged_batch

if TYPE_CHECKING:
    from pagedkv.kernels.attention_config import KernelConfig, Tuning
    from pagedkv.kernels.testing import PagedBatch

HQ, HKV, D, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16


def llama_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    head_size: int = D,
    block_size: int = BLOCK,
    seed: int = 0,
    device: str = "cuda",
) -> PagedBatch:
    """`random_paged_batch` with HQ query heads over HKV KV heads, blocks of BLOCK (or `block_size`),
    DTYPE values."""
    return random_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=head_size,
        block_size=block_size,
        dtype=DTYPE,
        device=device,
        seed=seed,
    )


def batch_config(batch: PagedBatch, tuning: Tuning | None = None, kv_bytes: int = 2) -> KernelConfig:
    """`choose_config` for `batch` from its shapes and host-side lengths, as the backend's metadata
    builder calls it once per step; `tuning` None means choose_config's default tuning; `kv_bytes`: 1
    for an fp8 cache."""
    q, num_kv_heads = batch.q, batch.k_cache.shape[2]
    # The kernel pads K and V heads to one width: the wider of the two (unified_attention's own default).
    head_pad = max(triton.next_power_of_2(q.shape[2]), triton.next_power_of_2(batch.v_cache.shape[3]))
    return choose_config(
        device=q.device,
        head_pad=head_pad,
        dtype=q.dtype,
        num_queries_per_kv=q.shape[1] // num_kv_heads,
        num_kv_heads=num_kv_heads,
        num_reqs=len(batch.query_lens),
        num_tokens=q.shape[0],
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        kv_bytes=kv_bytes,
        **({} if tuning is None else {"tuning": tuning}),
    )
