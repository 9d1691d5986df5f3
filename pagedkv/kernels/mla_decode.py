"""Decode attention for multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache.

MLA caches ONE vector per token per layer instead of a K and a V per head: the normalised latent
`c_kv` followed by the rotated positional key `k_pe`. A cache row looks like

    cache[block, slot, :]  =  [ c_kv (kv_lora_rank, e.g. 512)  |  k_pe (rope_dim, e.g. 64) ]
                               \\________ the value ________/
                               \\______________ the key (all 576 values) ______________/

At decode the up-projection W_UK is absorbed into the query, so every head's query is a
576-vector against the same rows: multi-query attention with ONE shared KV head, and the value is
the latent part of the very rows the scores were computed from:

    s_j = scale * q . cache[j],   p = softmax(s),   out = sum_j p_j * cache[j][:kv_lora_rank]

The grid is (head block, split, request):

    head block h:  BLOCK_H query heads of one request share every cache row they read, so a tile
                   of rows is loaded once and used by all of them in [BLOCK_H, D] x [D, BLOCK_N]
                   dots (tensor cores on a GPU). The row is loaded in pieces: c_kv in four
                   quarters (independent dot chains, see the kernel) and k_pe, which also
                   lets 512 + 64 = 576 (not a power of two) be loaded exactly.
    split s:       with few requests there are too few programs to keep the GPU busy, so each
                   request's tokens are cut into `num_splits` contiguous, page-aligned ranges:

         tokens of request r:  | split 0 | split 1 | split 2 |   (each: whole pages / tiles)
                                   |         |         |
                      partial out + log-sum-exp  ->  merge (pagedkv.kernels.split_kv)

Each program walks its pages through the block table with an online softmax, accumulating a
[BLOCK_H, kv_lora_rank] float32 tile. Sizes that are not powers of two run padded and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv.kernels.attention_config import split_count
from pagedkv.kernels.common import (
    cdiv,
    check_attention_dtype,
    check_pages_on_cpu,
    check_tensors,
    interpreting,
    is_hopper_or_newer,
    next_power_of_2,
    num_compute_units,
)
from pagedkv.kernels.split_kv import SplitKVWorkspace, merge_splits
from pagedkv.kernels.unified_attention import LOG2_E, _dot

BLOCK_H = 16  # query heads per program: the smallest M of a tensor-core dot
MAX_MLA_SPLITS = 32  # more splits mostly add partial-result traffic (32 KB per split and head block)
SPLIT_OVERHEAD_TOKENS = 128  # a program's fixed cost (query load, partial write + merge read, start-up) in rows


@dataclass(frozen=True)
class MLATiles:
    """Launch shape of the kernel on a GPU; `benchmarks/mla_decode.py --sweep` times alternatives."""

    block_n: int = 32
    """Cache rows per tile: 32 x 576 bf16 = 36 KB per buffer; 168 registers, 93 KB shared memory."""
    num_warps: int = 4
    num_stages: int = 3
    """Pipeline depth: 3 = the next tile is loaded while this one is computed (2 buffers)."""
    programs_per_sm: int = 2
    """How many programs of this shape an SM runs at once (for the split count)."""


GPU_TILES = MLATiles()  # 16-bit inputs on a GPU
FP32_TILES = MLATiles(block_n=16, num_stages=1)  # fp32 rows are twice as wide
# The interpreter runs programs one after another: small tiles keep tests quick, and tiny test
# sequences still cross several tiles, pages and splits.
INTERPRETER_TILES = MLATiles(block_n=8, num_stages=1)


class MLADecodeWorkspace(SplitKVWorkspace):
    """Split-KV scratch for `mla_decode_attention`; allocate once, reuse every step (CUDA-graph safe).

    Holds `max_decodes * max_splits` partial rows of [num_heads, kv_lora_rank] float32
    (rows x num_heads x kv_lora_rank x 4 bytes) plus, for the merge, the offsets of each
    request's single query token (`query_start_loc = arange`), made here so no call allocates.
    """

    def __init__(
        self,
        max_decodes: int,
        num_heads: int,
        kv_lora_rank: int,
        device: torch.device | str,
        max_splits: int = MAX_MLA_SPLITS,
    ) -> None:
        super().__init__(max_decodes * max_splits, num_heads, kv_lora_rank, device)
        self.max_decodes = max_decodes
        self.query_start_loc = torch.arange(max_decodes + 1, dtype=torch.int32, device=device)


@triton.jit
def _page_rows(block_table_row, tokens, end, stride_c_b, stride_c_s, PAGE_SIZE: tl.constexpr):
    """Offsets of the cache rows of `tokens` (tokens past `end` read block 0, the null block;
    their loads are masked anyway): the paging. Token t lives in physical
    block block_table[r, t // PAGE_SIZE], slot t % PAGE_SIZE (shifts: PAGE_SIZE is a power of two).

    The block table is read with an L2 "evict last" hint, like seq_lens: the cache rows streaming
    past would otherwise push these few KB (read again by every layer of the step) out of L2.
    """
    block = tl.load(block_table_row + tokens // PAGE_SIZE, mask=tokens < end, other=0, eviction_policy="evict_last").to(
        tl.int64
    )
    return (block * stride_c_b + (tokens % PAGE_SIZE) * stride_c_s)[:, None]


@triton.jit
def _cols(rows, row_ok, stride_d, FIRST: tl.constexpr, COUNT: tl.constexpr, LIMIT: tl.constexpr):
    """Offsets and mask of columns FIRST .. FIRST + COUNT - 1 of `rows` ([n, 1] offsets).

    Rows that are not ok and columns from LIMIT on (padding) are masked: loads read 0 there, not
    garbage (they still meet the dots, and 0 x NaN = NaN), stores skip them. The column mask exists
    only when the range passes LIMIT (a compile-time choice), so the DeepSeek shape (512 + 64)
    moves whole rows with vector loads.
    """
    cols = FIRST + tl.arange(0, COUNT)[None, :]
    mask = row_ok[:, None] & (cols < LIMIT) if FIRST + COUNT > LIMIT else row_ok[:, None]
    return rows + cols * stride_d, mask


@triton.jit
def _load_cols(ptr, rows, row_ok, stride_d, FIRST: tl.constexpr, COUNT: tl.constexpr, LIMIT: tl.constexpr):
    """[n, COUNT] values of columns FIRST .. FIRST + COUNT - 1 (masked places read 0)."""
    offsets, mask = _cols(rows, row_ok, stride_d, FIRST, COUNT, LIMIT)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _store_cols(
    ptr,
    rows,
    row_ok,
    stride_d,
    values,
    FIRST: tl.constexpr,
    COUNT: tl.constexpr,
    LIMIT: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Store `values` into columns FIRST .. FIRST + COUNT - 1 (masked places are skipped)."""
    offsets, mask = _cols(rows, row_ok, stride_d, FIRST, COUNT, LIMIT)
    tl.store(ptr + offsets, values, mask=mask, eviction_policy=EVICT)


@triton.jit(do_not_specialize=["num_heads", "num_splits"])  # per-step values: no variant per value
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,  # out: the final output, or the split partials
    lse_ptr,  # split partials only: log2-sum-exp per row and head
    block_table_ptr,
    seq_lens_ptr,
    num_heads,
    num_splits,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_c_b,
    stride_c_s,
    stride_c_d,
    stride_o_r,
    stride_o_h,
    stride_o_d,  # row = request * num_splits + split
    stride_lse_r,
    stride_lse_h,
    stride_bt,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    LORA_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_UNIT: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    OUT_EVICT: tl.constexpr,
    EARLY_MERGE: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program: BLOCK_H heads of one request, one split of its tokens."""
    if EARLY_MERGE:  # the merge kernel may be launched now (it waits for this kernel's end itself)
        tl.extra.cuda.gdc_launch_dependents()
    Q: tl.constexpr = LORA_PAD // 4  # the latent is handled in quarters (see the scores below)
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req, eviction_policy="evict_last")  # see _page_rows

    # This split's tokens [start, end): whole SPLIT_UNITs (pages, or tiles of several pages), so
    # no page and no tile is cut in two. Splits past the end get nothing (and weigh 0 in the merge).
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLIT_UNIT), num_splits) * SPLIT_UNIT
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    # The running softmax denominator, kept per score column and summed over the columns once
    # at the end: a row sum in every iteration is one more exchange between the warps (each warp
    # holds some of the columns) and two more barriers on the loop's critical path.
    l_cols = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    acc0 = tl.zeros([BLOCK_H, Q], tl.float32)  # the output, a quarter of the latent each
    acc1 = tl.zeros([BLOCK_H, Q], tl.float32)
    acc2 = tl.zeros([BLOCK_H, Q], tl.float32)
    acc3 = tl.zeros([BLOCK_H, Q], tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # The next tile's block ids are read one iteration early (`rows` is carried over): then no
    # cache load waits on a block-table load of its own iteration, and Triton's pipeliner can
    # fetch the next tile while this one is computed (num_stages buffers). Reading them in the
    # same iteration left the loop unpipelined: 218 instead of 184 us for 128 x 4096 on an H200.
    tokens = start + tl.arange(0, BLOCK_N)
    rows = _page_rows(block_table_row, tokens, end, stride_c_b, stride_c_s, PAGE_SIZE)
    # Launched early (EARLY_LAUNCH), the program has read its length and first block ids while
    # the kernel before it was still running; the query and the cache may come from that kernel,
    # and the partials of the last call may still be read by its merge, so wait for it here.
    if EARLY_LAUNCH:
        tl.extra.cuda.gdc_wait()
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads  # the last head block may be partly empty
    q_rows = (req.to(tl.int64) * stride_q_t + heads * stride_q_h)[:, None]
    # Padded heads and dims read 0: they add 0 to every score and are never stored.
    q0 = _load_cols(q_ptr, q_rows, head_ok, stride_q_d, 0 * Q, Q, KV_LORA_RANK)
    q1 = _load_cols(q_ptr, q_rows, head_ok, stride_q_d, 1 * Q, Q, KV_LORA_RANK)
    q2 = _load_cols(q_ptr, q_rows, head_ok, stride_q_d, 2 * Q, Q, KV_LORA_RANK)
    q3 = _load_cols(q_ptr, q_rows, head_ok, stride_q_d, 3 * Q, Q, KV_LORA_RANK)
    q_pe = _load_cols(q_ptr, q_rows, head_ok, stride_q_d, KV_LORA_RANK, ROPE_PAD, KV_LORA_RANK + ROPE_DIM)

    for _ in range(start, end, BLOCK_N):
        in_seq = tokens < end
        c0 = _load_cols(cache_ptr, rows, in_seq, stride_c_d, 0 * Q, Q, KV_LORA_RANK)
        c1 = _load_cols(cache_ptr, rows, in_seq, stride_c_d, 1 * Q, Q, KV_LORA_RANK)
        c2 = _load_cols(cache_ptr, rows, in_seq, stride_c_d, 2 * Q, Q, KV_LORA_RANK)
        c3 = _load_cols(cache_ptr, rows, in_seq, stride_c_d, 3 * Q, Q, KV_LORA_RANK)
        k_pe = _load_cols(cache_ptr, rows, in_seq, stride_c_d, KV_LORA_RANK, ROPE_PAD, KV_LORA_RANK + ROPE_DIM)
        rows = _page_rows(block_table_row, tokens + BLOCK_N, end, stride_c_b, stride_c_s, PAGE_SIZE)

        # The scores in two independent halves. Triton rewrites `dot(a, b) + dot(c, d)` as one
        # accumulation (the second dot starts from the first's result), so one dot over all 576
        # values is a chain of 36 tensor-core steps, each waiting for the one before. Summed as
        # (q0.c0 + q1.c1) + (q2.c2 + q3.c3), the two chains of 16 steps run side by side:
        # 128 x 4096 took 154 instead of 184 us on an H200. (Quarters, not halves: with [BLOCK_N,
        # 256] tiles Triton's address arithmetic alone cost ~5 more points of bandwidth.)
        s = (
            (_dot(q0, tl.trans(c0), DOT_PRECISION, UPCAST) + _dot(q1, tl.trans(c1), DOT_PRECISION, UPCAST))
            + (_dot(q2, tl.trans(c2), DOT_PRECISION, UPCAST) + _dot(q3, tl.trans(c3), DOT_PRECISION, UPCAST))
            + _dot(q_pe, tl.trans(k_pe), DOT_PRECISION, UPCAST)
        )
        s = tl.where(in_seq[None, :], s * qk_scale, float("-inf"))  # qk_scale includes log2(e)
        # Online softmax in base 2. Every tile has a token in range, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        alpha = alpha[:, None]
        l_cols = l_cols * alpha + p
        p = p.to(c0.dtype)
        acc0 = acc0 * alpha + _dot(p, c0, DOT_PRECISION, UPCAST)  # V = c_kv
        acc1 = acc1 * alpha + _dot(p, c1, DOT_PRECISION, UPCAST)
        acc2 = acc2 * alpha + _dot(p, c2, DOT_PRECISION, UPCAST)
        acc3 = acc3 * alpha + _dot(p, c3, DOT_PRECISION, UPCAST)
        m_i = m_new
        tokens += BLOCK_N

    l_i = tl.sum(l_cols, 1)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no tokens (empty request or split): output 0
    out_rows = req.to(tl.int64) * num_splits + split  # without splits: num_splits = 1, row = req
    out = (out_rows * stride_o_r + heads * stride_o_h)[:, None]
    _store_cols(out_ptr, out, head_ok, stride_o_d, acc0 / l_safe[:, None], 0 * Q, Q, KV_LORA_RANK, OUT_EVICT)
    _store_cols(out_ptr, out, head_ok, stride_o_d, acc1 / l_safe[:, None], 1 * Q, Q, KV_LORA_RANK, OUT_EVICT)
    _store_cols(out_ptr, out, head_ok, stride_o_d, acc2 / l_safe[:, None], 2 * Q, Q, KV_LORA_RANK, OUT_EVICT)
    _store_cols(out_ptr, out, head_ok, stride_o_d, acc3 / l_safe[:, None], 3 * Q, Q, KV_LORA_RANK, OUT_EVICT)
    if SPLIT_KV:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + out_rows * stride_lse_r + heads * stride_lse_h, lse, mask=head_ok)


def _tiles(dtype: torch.dtype, device: torch.device) -> MLATiles:
    if device.type != "cuda" or interpreting():
        return INTERPRETER_TILES
    return FP32_TILES if dtype == torch.float32 else GPU_TILES


def default_num_kv_splits(
    num_decodes: int,
    num_heads: int,
    max_seq_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Split count from host-side facts only (the same at CUDA-graph capture and replay).

    Enough programs to fill every SM in as few waves as possible, each split at least a couple
    of tiles long (the wave / start-up cost model of the MHA kernel, `split_count`).
    """
    tiles = _tiles(dtype, device)
    unit = max(tiles.block_n, block_size)
    base_programs = num_decodes * cdiv(num_heads, BLOCK_H)
    slots = tiles.programs_per_sm * num_compute_units(device)
    splits = split_count(base_programs, cdiv(max(max_seq_len, 1), unit), slots, cdiv(SPLIT_OVERHEAD_TOKENS, unit))
    return min(splits, MAX_MLA_SPLITS)


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor,
    workspace: MLADecodeWorkspace | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    early_launch: bool = False,
) -> torch.Tensor:
    """MLA decode attention (one query token per request, one shared latent KV head); writes `out`.

    q: [num_decodes, num_heads, kv_lora_rank + rope_dim] (W_UK already absorbed). kv_cache:
    [num_blocks, block_size, kv_lora_rank + rope_dim], block_size a power of two. block_table:
    int32 [>= num_decodes, max_blocks]. seq_lens: int32 [>= num_decodes] (0 gives a zero output).
    out: [num_decodes, num_heads, kv_lora_rank], any of fp16/bf16/fp32; the math is fp32.

    `workspace` enables split-KV; without it each request is one range (no merge). With it the
    split count is `num_kv_splits`, or chosen from the batch, `max_seq_len` (a host-side bound;
    default: the block table's capacity) and the SM count, and the call neither allocates nor
    syncs with the device.

    `early_launch` (Hopper and later; ignored elsewhere): the kernel starts while the kernel
    launched before it still runs (programmatic dependent launch) and reads `seq_lens` and
    `block_table` before waiting for it: only pass True when neither was written by that kernel,
    as with metadata built at the start of a step (TRITON_MLA). The query and the cache are read
    after the wait. (+0.3-0.6 us a call on an H200, ~1 point of bandwidth at 32 x 4096.)
    """
    _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, out)
    num_decodes, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[1]
    check_pages_on_cpu(block_table, seq_lens[:num_decodes], kv_cache.shape[0], block_size)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be None or >= 1, got {num_kv_splits}")
    if workspace is None and (num_kv_splits or 1) > 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} needs scratch: pass workspace=MLADecodeWorkspace(...)")
    if num_decodes == 0:
        return out

    num_splits = 1
    if workspace is not None:
        _check_workspace(workspace, num_decodes, num_heads, kv_lora_rank, q.device)
        fits = workspace.rows // num_decodes  # partial rows are request * num_splits + split
        if num_kv_splits is None:
            bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
            num_kv_splits = min(
                default_num_kv_splits(num_decodes, num_heads, bound, block_size, q.dtype, q.device), fits
            )
        elif num_kv_splits > fits:
            raise ValueError(
                f"num_kv_splits={num_kv_splits} x {num_decodes} decodes exceeds the workspace's {workspace.rows} "
                f"rows: use num_kv_splits <= {fits} or a larger MLADecodeWorkspace(max_splits=...)"
            )
        num_splits = num_kv_splits

    tiles = _tiles(q.dtype, q.device)
    # The merge's launch overlaps this kernel's last programs (0.5-1 point of bandwidth at 32 x 4096).
    pdl = is_hopper_or_newer(q.device)
    early_merge = num_splits > 1 and pdl
    early_launch = early_launch and pdl
    if num_splits > 1:
        assert workspace is not None  # splits are chosen above only with a workspace
        target, lse = workspace.views(num_decodes, num_splits)
    else:
        target, lse = out, out  # lse is unused without splits
    grid = (cdiv(num_heads, BLOCK_H), num_splits, num_decodes)  # head blocks of one request run side by side (L2)
    _mla_decode_kernel[grid](
        q,
        kv_cache,
        target,
        lse,
        block_table,
        seq_lens,
        num_heads,
        num_splits,
        scale * LOG2_E,
        *q.stride(),
        *kv_cache.stride(),
        *target.stride(),
        *lse.stride()[:2],
        block_table.stride(0),
        KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=head_dim - kv_lora_rank,
        LORA_PAD=max(64, next_power_of_2(kv_lora_rank)),
        ROPE_PAD=max(16, next_power_of_2(head_dim - kv_lora_rank)),
        BLOCK_H=BLOCK_H,
        BLOCK_N=tiles.block_n,
        PAGE_SIZE=block_size,
        SPLIT_UNIT=max(tiles.block_n, block_size),
        SPLIT_KV=num_splits > 1,
        # Partials stay in L2 for the merge (and the next call overwrites them there): written
        # back to HBM they cost ~3 points of bandwidth at 32 x 4096. The final output needs no hint.
        OUT_EVICT="evict_last" if num_splits > 1 else "",
        EARLY_MERGE=early_merge,
        EARLY_LAUNCH=early_launch,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting() and q.dtype == torch.bfloat16,  # the interpreter's bf16 dot is wrong
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=early_launch,
    )
    if num_splits > 1:
        assert workspace is not None  # as above
        merge_splits(
            target, lse, out, workspace.query_start_loc[: num_decodes + 1], num_splits, early_launch=early_merge
        )
    return out


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor,
) -> None:
    check_tensors(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, out=out)
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(
            f"q must be [num_decodes, num_heads, kv_lora_rank + rope_dim] and kv_cache [num_blocks, block_size, "
            f"kv_lora_rank + rope_dim]; got q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[2] != q.shape[2]:
        raise ValueError(
            f"q rows have {q.shape[2]} values but cache rows {kv_cache.shape[2]}: both must be kv_lora_rank + rope_dim"
        )
    if not isinstance(kv_lora_rank, int):
        raise TypeError(f"kv_lora_rank must be an int (DeepSeek: 512), got {kv_lora_rank!r}")
    if not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} leaves a rope part of {q.shape[2] - kv_lora_rank} values in rows of "
            f"{q.shape[2]}: use 0 < kv_lora_rank < {q.shape[2]} (DeepSeek: 512 of 576)"
        )
    expected = (q.shape[0], q.shape[1], kv_lora_rank)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"out must be [num_decodes, num_heads, kv_lora_rank] = {list(expected)}, got {list(out.shape)}"
        )
    for name, tensor in (("q", q), ("kv_cache", kv_cache), ("out", out)):
        check_attention_dtype(tensor.dtype, name)
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal the query dtype {q.dtype}")
    block_size = kv_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two (1, 2, 4, 8, 16, ... work)")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_table and seq_lens must be int32, got {block_table.dtype} and {seq_lens.dtype}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] < q.shape[0]
        or seq_lens.dim() != 1
        or seq_lens.shape[0] < q.shape[0]
    ):
        raise ValueError(
            f"{q.shape[0]} decodes need block_table [>= {q.shape[0]}, max_blocks] and seq_lens [>= {q.shape[0]}]; "
            f"got {tuple(block_table.shape)}, {tuple(seq_lens.shape)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")


def _check_workspace(
    workspace: MLADecodeWorkspace,
    num_decodes: int,
    num_heads: int,
    kv_lora_rank: int,
    device: torch.device,
) -> None:
    if not isinstance(workspace, MLADecodeWorkspace):
        raise ValueError(f"workspace must be an MLADecodeWorkspace, got {type(workspace).__name__}")
    if tuple(workspace.partial_out.shape[1:]) != (num_heads, kv_lora_rank) or workspace.partial_out.device != device:
        raise ValueError(
            f"workspace holds [rows, {workspace.partial_out.shape[1]}, {workspace.partial_out.shape[2]}] on "
            f"{workspace.partial_out.device}; this call needs [rows, {num_heads}, {kv_lora_rank}] on {device}"
        )
    if num_decodes > workspace.max_decodes:
        raise ValueError(f"{num_decodes} decodes exceed the workspace's max_decodes={workspace.max_decodes}")
