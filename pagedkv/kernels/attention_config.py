"""Launch parameters of the paged attention kernel: tile shapes, warps, pipelining and splits.

Two regimes decide everything:

* **Prefill-like** batches (some request has many query tokens) are bound by the tensor cores.
  Each request's queries are cut into tiles (128 query rows x 128 keys for long prompts, 64 x
  32 otherwise) and every (query tile, KV head) pair is one program.
* **Decode-like** batches (every request's queries fit in one small tile) are bound by memory
  bandwidth: each program streams its sequence's K and V once. With few sequences there are
  too few programs to keep every multiprocessor loading, so the key range of each sequence is
  *split* over several programs whose partial results are merged afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from pagedkv.kernels.common import by_size, cdiv, interpreting, is_hopper_or_newer, next_power_of_2, num_compute_units

MAX_SPLITS = 64
"""Most programs one sequence's keys are split over."""


@dataclass(frozen=True)
class Tiles:
    """Tile shape and launch parameters of one regime."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    """Registers per thread the compiler may use (Triton's `maxnreg`); None: its own choice."""


@dataclass(frozen=True)
class Tuning:
    """The knobs of `choose_config`, chosen from sweeps on an H200 (head size 128, bf16).

    Other head sizes derive from these (half the rows and keys above 128). `benchmarks/
    attention.py --sweep decode|prefill` times alternatives (see benchmarks/README.md).
    """

    decode: Tiles = Tiles(16, 64, 4, 2)
    """block_m is a minimum (the query rows of a request decide); 64 keys x 128 x 2 bytes =
    16 KB per K or V tile; 2 stages keep registers at ~126 so 4 programs fit on an SM."""
    fp8_decode: Tiles = Tiles(16, 64, 4, 2, max_registers=128)
    """Decode over an fp8 cache (1 byte per value). Its casts to fp16 take registers: capped at 128
    (no spills, triton 3.6), 4 programs still fit on an SM, as `decode`'s do. On an H100 (2026-12-07)
    1.40-1.41x the bf16 cache's speed; no tile tried did better than 1.51x: the limit is shared
    memory, not the tile (benchmarks/README.md, issue 45). `benchmarks/attention.py --sweep
    fp8-decode` searches it."""
    decode_programs_per_sm: int = 4
    """How many decode programs an SM runs at once (occupancy of the decode tiles above)."""
    split_overhead_tiles: int = 2
    """A program's fixed cost (loading Q and the block table, writing its part) in key tiles."""
    long_prefill: Tiles = Tiles(128, 128, 8, 3)
    """Long prompts: 8 warps = two Hopper warpgroups of 64 rows, long key loops (252 registers, no
    spills since the page table is read per page; 36 bytes spilled before)."""
    short_prefill: Tiles = Tiles(64, 64, 4, 3)
    """Short prompts and the prompts of mixed batches (H100, 2026-12-07, same run: 8 x 1,024 in 263 us
    against 275 for 64 x 32 x 4 warps x 2 stages, with a page-table entry loaded per page)."""
    long_prefill_tokens: int = 2048
    """Average query tokens per request from which the long-prefill tiles win."""
    split_mixed: bool = True
    """Run a batch of prompts and decodes as two launches, decodes with decode tiles (`KernelConfig.short_rows`)."""


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
    max_registers: int | None = None
    """Registers per thread the compiler may use (`Tiles.max_registers`)."""
    tma: bool = False
    """Prefill tiles: load q, K and V tiles with TMA copies (tensor descriptors) where the layout
    allows (`unified_attention._tma_descriptors`: pages of at least block_n keys); else pointers."""
    short_rows: KernelConfig | None = None
    """A mixed batch in two launches: the requests whose queries fit one tile of this (decode) config
    get a program each with it, the others the tiles above. (One tile shape for both would give a
    decode's 1-query tile the prefill's 64 or 128 rows: 16-32x the tensor-core work on every key it
    reads.) None: one launch."""


@functools.lru_cache(maxsize=4096)
def split_count(base_programs: int, num_tiles: int, slots: int, overhead: int) -> int:
    """Split count that minimises (waves of programs) x (tiles per program + fixed cost).

    Programs run in waves of `slots` (the GPU's concurrent programs). More splits fill a
    wave better and shorten each program, but a wave that is only partly full costs as much
    as a full one, and each program pays a fixed start-up cost. (Cached: the search tries up
    to 64 counts, and batches of the same shape recur step after step.)
    """

    def cost(splits: int) -> int:
        waves = cdiv(base_programs * splits, slots)
        return waves * (cdiv(num_tiles, splits) + overhead)

    return min(range(1, min(MAX_SPLITS, num_tiles) + 1), key=lambda splits: (cost(splits), splits))


def _block_m(num_queries_per_kv: int, max_query_len: int, prefill_rows: int) -> tuple[int, bool]:
    """Rows of a query tile, and whether every request fits in a single tile (decode-like)."""
    small = next_power_of_2(num_queries_per_kv * max_query_len)
    if small <= 64:
        # All queries of a request fit one tile: at least 16 rows (the smallest tl.dot).
        return max(16, small), True
    return max(prefill_rows, next_power_of_2(num_queries_per_kv)), False


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
    kv_bytes: int = 2,
    tuning: Tuning = Tuning(),
) -> KernelConfig:
    """Pick tiles for this batch from host-side facts only (shapes and the caller's Python ints).

    Nothing here reads device memory, so the choice is the same when a CUDA graph is captured
    and when it is replayed. `kv_bytes` is the cache's element size: an fp8 cache (1 byte)
    decodes with tiles of its own (`Tuning.fp8_decode`).
    """
    on_gpu = device.type == "cuda" and not interpreting()
    tensor_cores = on_gpu and dtype != torch.float32
    long = num_tokens >= tuning.long_prefill_tokens * num_reqs
    prefill = tuning.long_prefill if long else tuning.short_prefill
    if not tensor_cores:
        prefill = Tiles(32, 16, 4, 1)
    wide = head_pad > 128  # a [rows, head] accumulator this wide needs fewer rows per tile
    prefill_rows = prefill.block_m // 2 if wide and tensor_cores else prefill.block_m
    block_m, one_tile_per_req = _block_m(num_queries_per_kv, max_query_len, prefill_rows)

    if not tensor_cores:
        # The interpreter runs programs one after another: small tiles keep tests quick and still
        # cross several cache blocks, tiles and splits on short sequences. Exact fp32 dots run on
        # the CUDA cores, whose register-hungry code wants small tiles too.
        block_n, num_warps, max_registers = 16, 4, None
        num_stages = 2 if on_gpu and one_tile_per_req else 1
    else:
        decode_tiles = tuning.fp8_decode if kv_bytes == 1 else tuning.decode
        tiles = decode_tiles if one_tile_per_req else prefill
        block_n = tiles.block_n // 2 if wide else tiles.block_n
        num_warps = tiles.num_warps
        num_stages = min(tiles.num_stages, 2) if wide else tiles.num_stages
        max_registers = None if wide else tiles.max_registers  # a wider head needs its registers

    num_splits = 1
    if one_tile_per_req:
        slots = tuning.decode_programs_per_sm * num_compute_units(device)
        num_tiles = cdiv(max(max_seq_len, 1), block_n)
        num_splits = split_count(num_reqs * num_kv_heads, num_tiles, slots, tuning.split_overhead_tiles)
    short_rows = None
    short_q = max(16, next_power_of_2(num_queries_per_kv)) // num_queries_per_kv  # a decode tile's queries
    # Were every request longer than short_q, the batch would hold at least this many tokens: below it,
    # some request surely is a decode (or a short draft) and gets its own launch.
    if tuning.split_mixed and not one_tile_per_req and num_tokens < (num_reqs - 1) * (short_q + 1) + max_query_len:
        decode = choose_config(
            device=device,
            head_pad=head_pad,
            dtype=dtype,
            num_queries_per_kv=num_queries_per_kv,
            num_kv_heads=num_kv_heads,
            num_reqs=num_reqs,
            num_tokens=num_reqs * short_q,
            max_query_len=short_q,
            max_seq_len=max_seq_len,
            kv_bytes=kv_bytes,
            tuning=tuning,
        )
        # One split: a merge would run over every token's rows, the other launch's included.
        short_rows = dataclasses.replace(decode, num_splits=1)
    tma = not one_tile_per_req and tensor_cores and is_hopper_or_newer(device)
    return KernelConfig(block_m, block_n, num_warps, num_stages, num_splits, max_registers, tma, short_rows)


def batch_invariant_config(
    *, device: torch.device, head_pad: int, dtype: torch.dtype, num_queries_per_kv: int, max_query_len: int
) -> KernelConfig:
    """The batch-invariant mode's launch config (pagedkv/batch_invariant.py says why): a query row's
    keys are summed in the same order whatever batch it is in, where `choose_config` sizes key tiles
    and splits by the batch.

    * one key-tile size (64 keys; 32 for heads over 128) for every batch, tiles starting at key 0,
      so a row meets its keys in the same tiles, in the same order, in any batch (tiles past its last
      key are fully masked: they add exact zeros and rescale by exactly 1);
    * no split-KV (one split, whatever the sequence): splits would merge partial sums, and a prefill
      row is never split, so its decode twin must not be either;
    * the query-row tile (rows, warps, stages) is looked up by the rows of the batch's longest
      request in `INVARIANT_ATTENTION_TILES`. A tile changes which tensor-core instructions compute
      a row, not the order of its sums, and may join that table only while
      tests/gpu/test_batch_invariant_cuda.py finds every entry giving a row the same bits. Without
      tensor cores (float32, Triton's interpreter) and for heads over 128, which that test does not
      cover, one tile serves every batch.

    Host-side facts only (`max_query_len` is the builder's Python int): a CUDA graph captured with
    these tiles is replayed with them.
    """
    if max_query_len < 0:
        raise ValueError(f"max_query_len={max_query_len} is negative: pass the batch's longest query (0 or more)")
    on_gpu = device.type == "cuda" and not interpreting()
    tensor_cores = on_gpu and dtype != torch.float32
    min_rows = max(16, next_power_of_2(num_queries_per_kv))  # a tile holds every query head of a KV head
    if not tensor_cores:
        return KernelConfig(min_rows, 16, 4, 2 if on_gpu else 1)
    if head_pad > 128:
        return KernelConfig(min_rows, 32, 4, 2)
    tiles = by_size(INVARIANT_ATTENTION_TILES, num_queries_per_kv * max_query_len)
    return KernelConfig(max(tiles.block_m, min_rows), tiles.block_n, tiles.num_warps, tiles.num_stages)


INVARIANT_ATTENTION_TILES: tuple[tuple[int | None, Tiles], ...] = ((None, Tiles(64, 64, 4, 4)),)
"""The batch-invariant mode's attention tiles by the query rows of the batch's longest request
(query tokens x query heads per KV head): (largest rows, tiles) buckets, in order, 64 keys per tile
in every entry (the order of a row's sums).

One bucket, from an H100 (2026-12-07, benchmarks/invariant_attention_tiles.py and the gate in
tests/gpu): tiles of 64 or 128 rows (wgmma) give a row the same bits as each other, tiles of 16 or
32 rows (mma.sync) the same bits as each other, but the two families differ in about 2 tokens in
100 (by one bf16 unit in the last place). So the table holds one family only. Against the mode's
former 16-row tile, 64 rows, 4 warps, 4 stages took 364 us instead of 827 on a 4,096-token prefill
and 260 instead of 246 on W1's decode step of 128 requests, and no member of the 64-row family was
faster than it on a batch of any bucket."""

INVARIANT_ATTENTION_TILE_CHOICES: tuple[Tiles, ...] = tuple(dict.fromkeys(t for _, t in INVARIANT_ATTENTION_TILES))
"""Every tile `batch_invariant_config` can pick on tensor cores for heads up to 128 (its rows raised
to the query heads of a KV head where there are more than 64): the set whose outputs tests/gpu must
find bitwise equal."""
