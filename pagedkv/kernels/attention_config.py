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


@dataclass(frozen=True)
class Tuning:
    """The knobs of `choose_config`, for head size 128 in 16-bit types on the tensor cores.

    Other head sizes derive from these (halved key tiles above 128). `benchmarks/attention.py
    --sweep` measures alternatives on a GPU.
    """

    decode_block_n: int = 64
    """Keys per tile when streaming K/V for decode (64 keys x 128 x 2 bytes = 16 KB per tile)."""
    decode_warps: int = 4
    decode_stages: int = 3
    """K/V tiles in flight per program: enough loads outstanding to cover memory latency."""
    programs_per_cu: int = 4
    """Decode aims for this many programs per multiprocessor, splitting the keys to get there."""
    min_tiles_per_split: int = 2
    """A split reads at least this many key tiles, so fixed costs (Q load, merge) stay small."""
    prefill_block_m: int = 128
    """Query rows per prefill tile: 8 warps = two Hopper warpgroups of 64 rows each."""
    prefill_block_n: int = 64
    prefill_warps: int = 8
    prefill_stages: int = 3


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


def _block_m(num_queries_per_kv: int, max_query_len: int, prefill_rows: int) -> tuple[int, bool]:
    """Rows of a query tile, and whether every request fits in a single tile (decode-like)."""
    small = triton.next_power_of_2(num_queries_per_kv * max_query_len)
    if small <= 64:
        # All queries of a request fit one tile: at least 16 rows (the smallest tl.dot).
        return max(16, small), True
    return max(prefill_rows, triton.next_power_of_2(num_queries_per_kv)), False


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
    tuning: Tuning = Tuning(),
) -> KernelConfig:
    """Pick tiles for this batch from host-side facts only (shapes and the caller's Python ints).

    Nothing here reads device memory, so the choice is the same when a CUDA graph is captured
    and when it is replayed.
    `split_rows_capacity` (rows of the split scratch buffer, None = unlimited) caps the splits.
    """
    on_gpu = device.type == "cuda" and not interpreting()
    tensor_cores = on_gpu and dtype != torch.float32
    wide = head_pad > 128  # a [rows, head] accumulator this wide needs fewer rows per tile
    if tensor_cores:
        prefill_rows = tuning.prefill_block_m // 2 if wide else tuning.prefill_block_m
    else:
        prefill_rows = 32
    block_m, one_tile_per_req = _block_m(num_queries_per_kv, max_query_len, prefill_rows)

    if not tensor_cores:
        # The interpreter runs programs one after another: small tiles keep tests quick and still
        # cross several cache blocks, tiles and splits on short sequences. Exact fp32 dots run on
        # the CUDA cores, whose register-hungry code wants small tiles too.
        block_n, num_warps = 16, 4
        num_stages = 2 if on_gpu and one_tile_per_req else 1
    elif one_tile_per_req:
        block_n = tuning.decode_block_n // 2 if wide else tuning.decode_block_n
        num_warps, num_stages = tuning.decode_warps, tuning.decode_stages
    else:
        block_n = tuning.prefill_block_n // 2 if wide else tuning.prefill_block_n
        num_warps = tuning.prefill_warps
        num_stages = min(tuning.prefill_stages, 2) if wide else tuning.prefill_stages

    num_splits = 1
    if one_tile_per_req:
        programs = num_reqs * num_kv_heads
        wanted = triton.cdiv(tuning.programs_per_cu * num_compute_units(device), max(programs, 1))
        worth = triton.cdiv(max_seq_len, block_n * tuning.min_tiles_per_split)
        num_splits = min(wanted, worth, MAX_SPLITS)
        if split_rows_capacity is not None:
            num_splits = min(num_splits, split_rows_capacity // max(num_tokens, 1))
        num_splits = max(num_splits, 1)
    return KernelConfig(block_m, block_n, num_warps, num_stages, num_splits)
