"""Input checks of `unified_attention`: shapes, dtypes and layouts, and, where the batch's offsets
are on the CPU (tests, exercises), the offsets against the host-side bounds. A wrong input fails
here with a message naming it, instead of reading or writing outside a tensor in the kernel."""

from __future__ import annotations

import torch

from pagedkv.kernels.common import check_attention_dtype, check_head_size, check_tensors
from pagedkv.kernels.reshape_and_cache import FP8_CACHE_DTYPES

NO_WINDOW = 1 << 30
"""An "unbounded" sliding window that still fits an int32 (what the kernel gets without a window)."""


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    check_tensors(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        out=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_size]; got {tuple(q.shape)}")
    if (
        k_cache.dim() != 4
        or v_cache.dim() != 4
        or v_cache.shape[:3] != k_cache.shape[:3]
        or k_cache.shape[3] != q.shape[2]
    ):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, {q.shape[2]}] and v_cache the same but for "
            f"its head size; got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    expected = (q.shape[0], q.shape[1], v_cache.shape[3])
    if tuple(out.shape) != expected:
        raise ValueError(
            f"out must be [num_tokens, num_q_heads, V's head size] = {list(expected)}, got {list(out.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    check_head_size(q.shape[2])
    check_head_size(v_cache.shape[3])
    for name, tensor in (("q", q), ("out", out)):  # the cache: its own check below
        check_attention_dtype(tensor.dtype, name)
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, *FP8_CACHE_DTYPES):
        raise ValueError(
            f"KV cache dtypes {k_cache.dtype} / {v_cache.dtype} must both equal the query dtype {q.dtype} "
            f"or both be one of {list(FP8_CACHE_DTYPES)}"
        )
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
    if (
        query_start_loc.dim() != 1
        or seq_lens.dim() != 1
        or block_table.dim() != 2
        or query_start_loc.shape[0] != seq_lens.shape[0] + 1
        or block_table.shape[0] < seq_lens.shape[0]
    ):
        raise ValueError(
            f"inconsistent batch: query_start_loc {tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)}, "
            f"block_table {tuple(block_table.shape)}; expected [num_reqs + 1], [num_reqs], [>= num_reqs, max_blocks]"
        )
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")


def check_batch_on_cpu(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
) -> None:
    """The ragged batch's offsets and the host-side bounds, checked where that is free (see
    `check_pages_on_cpu`): offsets past q read outside it, and a max_query_len below a request's
    query length leaves rows of `out` unwritten."""
    if query_start_loc.device.type != "cpu" or seq_lens.numel() == 0:
        return
    query_lens = query_start_loc.diff()
    if query_start_loc[0] != 0 or query_lens.min() < 0 or query_start_loc[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must rise from 0 to at most the {num_tokens} tokens of q, got {query_start_loc.tolist()}"
        )
    if (query_lens > seq_lens).any():
        raise ValueError(
            f"a request's query is longer than its sequence: query lengths {query_lens.tolist()}, "
            f"seq_lens {seq_lens.tolist()}"
        )
    if query_lens.max() > max_query_len or seq_lens.max() > max_seq_len:
        raise ValueError(
            f"max_query_len={max_query_len} and max_seq_len={max_seq_len} must bound the batch's "
            f"{query_lens.max().item()} and {seq_lens.max().item()}"
        )


def check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or not 1 <= sliding_window < NO_WINDOW):
        raise ValueError(f"sliding_window must be None or a positive int below {NO_WINDOW}, got {sliding_window}")
