"""The kernel config `unified_attention` would pick for a benchmark's paged batch, computed ahead of the call.

Shared by benchmarks/attention.py and benchmarks/host_overhead.py. It imports only `choose_config`
(and names `Tuning` for type checkers alone), so host_overhead.py can still time an older checkout
put first on PYTHONPATH.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton

from pagedkv.kernels.attention_config import choose_config

if TYPE_CHECKING:
    from pagedkv.kernels.attention_config import KernelConfig, Tuning
    from pagedkv.kernels.testing import PagedBatch


def batch_config(batch: PagedBatch, tuning: Tuning | None = None) -> KernelConfig:
    """`choose_config` for `batch` from its shapes and host-side lengths, as the backend's metadata
    builder calls it once per step; `tuning` None means choose_config's default tuning."""
    q, num_kv_heads = batch.q, batch.k_cache.shape[2]
    return choose_config(
        device=q.device,
        head_pad=triton.next_power_of_2(q.shape[2]),
        dtype=q.dtype,
        num_queries_per_kv=q.shape[1] // num_kv_heads,
        num_kv_heads=num_kv_heads,
        num_reqs=len(batch.query_lens),
        num_tokens=q.shape[0],
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        **({} if tuning is None else {"tuning": tuning}),
    )
