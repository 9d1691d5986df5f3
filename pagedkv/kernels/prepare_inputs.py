"""A step's input ids, positions and slot mappings, gathered from the request rows in two kernels.

Model Runner V2 builds a step's inputs on the GPU from its persistent request state
(vllm/v1/worker/gpu/input_batch.py: prepare_inputs, compute_slot_mappings): the host sends only
which rows run and how many tokens each. One program per request walks its query tokens:

    request i:  row = rows[i]   tokens query_start_loc[i] .. query_start_loc[i + 1]
                num_computed = seq_lens[i] - query_len
    token t:    position  = num_computed + (t - query_start_loc[i])
                input_id  = token_ids[row, position]
                slot      = block_table[row, position // block_size] * block_size + position % block_size

On the CPU the same is a handful of torch ops (pagedkv/worker/prepare_inputs.py); these kernels
replace about twenty small launches per step on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128
"""Tokens per loop iteration of a program (a prompt chunk loops; a decode is one masked pass)."""


@triton.jit
def _request_span(i, rows_ptr, query_start_loc_ptr, seq_lens_ptr):
    """Request i's row, its first and one-past-last packed token, and its tokens already cached."""
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(query_start_loc_ptr + i)
    end = tl.load(query_start_loc_ptr + i + 1)
    return row, start, end, tl.load(seq_lens_ptr + i) - (end - start)


@triton.jit
def _prepare_inputs_kernel(
    rows_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    token_ids_ptr,
    token_ids_stride,
    input_ids_ptr,
    positions_ptr,
    BLOCK: tl.constexpr,
):
    row, start, end, num_computed = _request_span(tl.program_id(0), rows_ptr, query_start_loc_ptr, seq_lens_ptr)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        mask = t < end
        position = num_computed + (t - start)
        ids = tl.load(token_ids_ptr + row * token_ids_stride + position, mask=mask)
        tl.store(input_ids_ptr + t, ids, mask=mask)
        tl.store(positions_ptr + t, position, mask=mask)


@triton.jit
def _slot_mapping_kernel(
    rows_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    block_table_stride,
    slot_mapping_ptr,
    block_size,
    BLOCK: tl.constexpr,
):
    row, start, end, num_computed = _request_span(tl.program_id(0), rows_ptr, query_start_loc_ptr, seq_lens_ptr)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        mask = t < end
        position = num_computed + (t - start)
        block = tl.load(block_table_ptr + row * block_table_stride + position // block_size, mask=mask)
        slot = block.to(tl.int64) * block_size + position % block_size
        tl.store(slot_mapping_ptr + t, slot, mask=mask)


def prepare_inputs(
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_ids: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Fill `input_ids` and `positions` [num_tokens] of `rows.shape[0]` requests from `token_ids`
    [rows, max_model_len] (their rows)."""
    _prepare_inputs_kernel[(rows.shape[0],)](
        rows, query_start_loc, seq_lens, token_ids, token_ids.stride(0), input_ids, positions, BLOCK=BLOCK
    )


def slot_mapping(
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Fill `out` [num_tokens] with each token's slot in one KV cache group's `block_table`."""
    _slot_mapping_kernel[(rows.shape[0],)](
        rows, query_start_loc, seq_lens, block_table, block_table.stride(0), out, block_size, BLOCK=BLOCK
    )
