"""A step's input ids, positions and slot mappings, gathered from the request rows by one kernel.

Model Runner V2 builds a step's inputs on the GPU from its persistent request state
(vllm/v1/worker/gpu/input_batch.py: prepare_inputs, compute_slot_mappings): the host sends only
which rows run and how many tokens each. One program per request walks its query tokens:

    request i:  row = rows[i]   tokens query_start_loc[i] .. query_start_loc[i + 1]
                num_computed = seq_lens[i] - query_len
    token t:    position  = num_computed + (t - query_start_loc[i])
                input_id  = token_ids[row, position]
                slot      = block_table[row, position // block_size] * block_size + position % block_size

On the CPU the same is a handful of torch ops (pagedkv/worker/prepare_inputs.py); one launch per KV
cache group (the first also writes ids and positions) replaces about twenty small ones on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 128
"""Tokens per loop iteration of a program (a prompt chunk loops; a decode is one masked pass)."""


@triton.jit
def _prepare_inputs_kernel(
    rows_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    token_ids_ptr,
    token_ids_stride,
    input_ids_ptr,
    positions_ptr,
    block_table_ptr,
    block_table_stride,
    slot_mapping_ptr,
    block_size,
    WRITE_IDS: tl.constexpr,
    WRITE_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per request: its tokens' ids and positions (WRITE_IDS) and their slots in one KV
    cache group (WRITE_SLOTS); a second group's slots are a second launch without WRITE_IDS."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(query_start_loc_ptr + i)
    end = tl.load(query_start_loc_ptr + i + 1)
    num_computed = tl.load(seq_lens_ptr + i) - (end - start)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        mask = t < end
        position = num_computed + (t - start)
        if WRITE_IDS:
            ids = tl.load(token_ids_ptr + row * token_ids_stride + position, mask=mask)
            tl.store(input_ids_ptr + t, ids, mask=mask)
            tl.store(positions_ptr + t, position, mask=mask)
        if WRITE_SLOTS:
            block = tl.load(block_table_ptr + row * block_table_stride + position // block_size, mask=mask)
            tl.store(slot_mapping_ptr + t, block.to(tl.int64) * block_size + position % block_size, mask=mask)


def prepare_inputs(
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_ids: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    block_tables: list[torch.Tensor],
    block_sizes: list[int],
    slot_mappings: list[torch.Tensor] | None,
) -> None:
    """Fill `input_ids` and `positions` [num_tokens] of `rows.shape[0]` requests from `token_ids`
    [rows, max_model_len] (their rows), and each KV cache group's slot mapping from its block table;
    `slot_mappings` None: the step writes nothing (the caller fills the slots with -1)."""
    launch = functools.partial(
        _prepare_inputs_kernel[(rows.shape[0],)],
        rows,
        query_start_loc,
        seq_lens,
        token_ids,
        token_ids.stride(0),
        input_ids,
        positions,
        BLOCK=BLOCK,
    )
    if slot_mappings is None:
        launch(block_tables[0], block_tables[0].stride(0), input_ids, 1, WRITE_IDS=True, WRITE_SLOTS=False)
        return
    for g, (table, block_size, slots) in enumerate(zip(block_tables, block_sizes, slot_mappings)):
        launch(table, table.stride(0), slots, block_size, WRITE_IDS=g == 0, WRITE_SLOTS=True)
