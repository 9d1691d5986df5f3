"""Launch parameters of the paged attention kernel: tile shapes, warps, pipelining and splits.

Two regimes decide everything:

* **Prefill-like** batches (some request has many query tokens) are bound by the tensor cores.
  Tiles of 128 query rows x 64 keys keep the matrix units busy; each request's queries are cut
  into tiles and every (query tile, KV head) pair is one program.
* **Decode-like** batches (every request's queries fit in one small tile) are bound by memory
  bandwidth: each program streams its sequence's K and V once. With few sequences there are
  too few programs to keep every multiprocessor loading, so the key range of each sequence is
  *split* over several programs whose partial results are merged afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pagedkv.kernels.common import interpreting, num_compute_units

MAX_SPLITS = 64
"""Most programs one sequence's keys are split over."""
MIN_TILES_PER_SPLIT = 2
"""A split reads at least this many key tiles, so fixed costs (Q load, merge) stay small."""
PROGRAMS_PER_COMPUTE_UNIT = 4
"""Decode aims for this many programs per multiprocessor: enough loads in flight to hide latency."""


@dataclass(frozen=True)
class KernelConfig:
    """One launch of the attention kernel."""

    block_m: int
    """Rows of a query tile: `block_m // num_queries_per_kv` tokens x all query heads of a KV head."""
    block_n: int
    """Keys per K/V tile (may span several cache blocks)."""
    num_warps: int
    num_stages: int
    """Software-pipelining depth: tiles being loaded while an earlier one is computed."""
    num_splits: int = 1
    """Programs sharing one sequence's key range (decode); 1 = no split, no merge kernel."""


def _block_m(num_queries_per_kv: int, max_query_len: int, head_pad: int, on_gpu: bool) -> tuple[int, bool]:
    """Rows of a query tile, and whether every request fits in a single tile (decode-like)."""
    small = triton.next_power_of_2(num_queries_per_kv * max_query_len)
    if small <= 64:
        # All queries of a request fit one tile: at least 16 rows (the smallest tl.dot).
        return max(16, small), True
    if not on_gpu:
        return max(32, triton.next_power_of_2(num_queries_per_kv)), False
    block_m = 64 if head_pad > 128 else 128
    return max(block_m, triton.next_power_of_2(num_queries_per_kv)), False


def choose_config(
    *,
    device: torch.device,
    head_pad: int,
    dtype: torch.dtype,
    num_queries_per_kv: int,
    num_kv_heads: int,
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    split_rows_capacity: int | None,
) -> KernelConfig:
    """Pick tiles for this batch from host-side facts only (shapes and the caller's Python ints).

    Nothing here reads device memory, so the choice is the same when a CUDA graph is captured
    and when it is replayed.
    `split_rows_capacity` (rows of the split scratch buffer, None = unlimited) caps the splits.
    """
    on_gpu = device.type == "cuda" and not interpreting()
    block_m, one_tile_per_req = _block_m(num_queries_per_kv, max_query_len, head_pad, on_gpu)

    if not on_gpu:
        # The interpreter runs programs one after another: small tiles keep tests quick and still
        # cross several cache blocks, tiles and splits on short sequences.
        block_n, num_warps, num_stages = 16, 4, 1
    elif one_tile_per_req:
        # Decode: stream K/V in 64-key tiles, 3 in flight (2 x 3 x 16 KB for head 128 in bf16).
        block_n = 32 if head_pad > 128 else 64
        num_warps, num_stages = 4, 3
    else:
        # Prefill: 8 warps = two Hopper warpgroups over 128 query rows.
        block_n = 32 if head_pad > 128 else 64
        num_warps = 8 if block_m >= 128 or head_pad > 128 else 4
        num_stages = 2 if head_pad > 128 or dtype == torch.float32 else 3

    num_splits = 1
    if one_tile_per_req:
        programs = num_reqs * num_kv_heads
        wanted = triton.cdiv(PROGRAMS_PER_COMPUTE_UNIT * num_compute_units(device), max(programs, 1))
        worth = triton.cdiv(max_seq_len, block_n * MIN_TILES_PER_SPLIT)
        num_splits = min(wanted, worth, MAX_SPLITS)
        if split_rows_capacity is not None:
            num_splits = min(num_splits, split_rows_capacity // max(num_tokens, 1))
        num_splits = max(num_splits, 1)
    return KernelConfig(block_m, block_n, num_warps, num_stages, num_splits)
