"""Causal attention over a paged KV cache: prefill, chunked prefill, decode and mixed batches.

The one idea: a paged cache is only an indirection. Key position `k` of request `r` lives at
`block_table[r, k // block_size]`, offset `k % block_size`; once each K/V tile is gathered
through that lookup, the rest is ordinary flash attention (tiles of keys, online softmax).

The grid is (query tile x KV head, split), the (query tile, KV head) work items heaviest first:

* A **query tile** holds `BLOCK_Q` consecutive query tokens of one request times the
  `G = num_q_heads // num_kv_heads` query heads that share one KV head (GQA/MQA), flattened to
  `BLOCK_M = BLOCK_Q * G` rows. Every K/V tile is therefore loaded once for all G heads.
* Ragged batches need no host sync: request `r` owns tile slots starting at
  `query_start_loc[r] // BLOCK_Q + r`, which is always enough slots; a program finds its request
  by binary search and exits if its slot is unused. `num_tokens // BLOCK_Q + num_reqs` slots
  cover any batch.
* **Split-KV** (decode): when each request fits one tile, there may be too few programs to fill
  the GPU. Then the key range is cut into `num_splits` parts, each program writes its normalised
  partial output plus its log-sum-exp, and a small second kernel merges the parts.
* **Mixed batches** (prompts and decodes) run as two launches of this kernel, each skipping the
  other's requests: the decodes one program each with decode tiles, the prompts with prefill tiles
  (`KernelConfig.short_rows`).
* **TMA** (Hopper): where a page holds whole key tiles (block size a multiple of BLOCK_N), a
  prefill launch loads q and each K/V tile as one tensor-descriptor box (`_tma_descriptors`);
  otherwise the tile is gathered key by key through pointers (pages of 16 with a random page
  table: Hopper's copy engine copies boxes, it has no gather).
* **Head sizes** that are not a power of two (80, 96, ...) run in tiles padded to the next one
  (`HEAD_PAD`). Every access masks the padded dims, so nothing outside q, the cache or out is
  read or written; for a power-of-two head the mask is compiled out. V may have a head size of
  its own (`HEAD_SIZE_V`, the size of the output): MLA's prefill attends with K of 192 values
  and V of 128.
* An **fp8 cache** (e4m3, one byte per value; pagedkv/kv_cache/fp8.py) holds `x / scale`. A tile
  is loaded as fp8 and cast to fp16 for the dots (exact: every e4m3 value is an fp16 value; the
  GPU converts a pair of e4m3 values to fp16 in one instruction on sm_89 and later, and reaches
  bf16 only by way of fp16 and fp32; V's cast: `_widen_fp8_tile`); a bf16 query is cast to fp16
  once per program (its 10-bit mantissa holds bf16's 7 bits; it saturates at fp16's +-65504, far
  above any query). The dequantizing multiply `* scale` is
  folded into scalars: q . (k * k_scale) = (q . k) * k_scale joins the softmax scale, and
  sum p (v * v_scale) = v_scale * sum p v multiplies the output once. So a decode reads half the
  bytes of a bf16 cache and does no extra work per element but the cast.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedkv.kernels.attention_checks import NO_WINDOW, check_attention_inputs, check_batch_on_cpu, check_window
from pagedkv.kernels.attention_config import KernelConfig, choose_config
from pagedkv.kernels.common import (
    check_pages_on_cpu,
    interpreting,
    next_power_of_2,
)
from pagedkv.kernels.reshape_and_cache import FP8_CACHE_DTYPES, check_kv_scales
from pagedkv.kernels.split_kv import SplitKVWorkspace, merge_splits

LOG2_E = 1.4426950408889634
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_tile, BLOCK_Q: tl.constexpr):
    """Largest request r whose first tile slot `query_start_loc[r] // BLOCK_Q + r` is <= q_tile."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST works around Triton's CPU interpreter, which
    multiplies bf16 operands as raw 16-bit integers (seen in triton 3.6 and 3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_kv(ptrs, in_seq, dim_ok, MASKED: tl.constexpr, PADDED: tl.constexpr):
    """One [BLOCK_N, HEAD_PAD] K or V tile; keys past the sequence and dims past the head read 0.

    Both masks are compile-time choices: a full tile of a power-of-two head (HEAD_PAD ==
    HEAD_SIZE) loads with no mask at all. Masked lanes must read a finite 0, since they still enter
    the dots: a padded K dim meets the query's zero, a masked V row meets p = 0, and 0 x NaN
    would poison the whole row.
    """
    if MASKED:
        mask = in_seq[:, None]
        if PADDED:
            mask = mask & dim_ok[None, :]
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif PADDED:
        tile = tl.load(ptrs, mask=dim_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _widen_fp8_tile(v):
    """An fp8 V tile [keys, dims] cast to fp16 here, in registers, before its dot stages it in
    shared memory. Cast directly, the compiler moves the cast after the staging: it stages the
    fp8 tile and gathers it into the dot's operand layout byte by byte (V is the dot's right
    operand with its contiguous dim across, which 8-bit values cannot be loaded transposed in),
    with copies of 8 bytes instead of 16. Cut into (even, odd) dim pairs and joined again after the
    cast, the tile passes ops the compiler does not move across (triton 3.6, sm_90: no byte loads,
    16-byte copies, ldmatrix, 154 registers instead of 168)."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1] // 2, 2]))
    return tl.reshape(tl.join(even.to(tl.float16), odd.to(tl.float16)), [v.shape[0], v.shape[1]])


@triton.jit
def _attend_key_tile(
    acc,
    m_i,
    l_i,
    q,
    tile,
    k_base,
    v_base,
    kv_col,
    block_table_row,
    positions,
    seq_len,
    sliding_window,
    qk_scale,
    stride_kc_b,
    stride_kc_s,
    stride_vc_b,
    stride_vc_s,
    dims_kv_k,
    dims_kv_v,
    dim_ok,
    v_dim_ok,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    PADDED: tl.constexpr,
    PADDED_V: tl.constexpr,  # K's / V's head padded to a power of two
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold one tile of BLOCK_N keys into the running softmax state (online softmax)."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # The paging: each key's physical block comes from the request's block table row.
    # (PAGE_SIZE is a compile-time constant, so // and % are shifts and masks.)
    page = keys // PAGE_SIZE
    offset = keys % PAGE_SIZE
    in_seq = keys < seq_len
    if TMA:
        # The tile lies inside one page (PAGE_SIZE % BLOCK_N == 0): K and V tiles are boxes of the cache
        # seen as [slots, kv heads x head], one TMA copy each, straight into shared memory. Keys past
        # the sequence hold whatever the page held before: V's must be zeros (p = 0 times a NaN is NaN).
        first_key = tile * BLOCK_N
        row = tl.load(block_table_row + first_key // PAGE_SIZE) * PAGE_SIZE + first_key % PAGE_SIZE
        k = k_base.load([row, kv_col])
        v = v_base.load([row, kv_col])
        if MASKED:
            v = tl.where(in_seq[:, None], v, 0.0)
    else:
        if q.shape[0] >= 64 and BLOCK_N > PAGE_SIZE:
            # Prefill tiles: one page-table entry per page, spread over its keys. (Saves registers and the
            # pipeline's 4-byte copies there: 128 x 128 tiles stop spilling. Decode tiles keep the
            # entry-per-key load below, which compiles to fewer registers for them: 125 against 154.)
            pages = tile * (BLOCK_N // PAGE_SIZE) + tl.arange(0, BLOCK_N // PAGE_SIZE)
            if MASKED:
                ids = tl.load(block_table_row + pages, mask=pages * PAGE_SIZE < seq_len, other=0)
            else:
                ids = tl.load(block_table_row + pages)
            block = tl.reshape(tl.broadcast_to(ids.to(tl.int64)[:, None], [BLOCK_N // PAGE_SIZE, PAGE_SIZE]), [BLOCK_N])
        elif MASKED:  # only boundary tiles pay for masks: keys past the sequence, causal, window
            block = tl.load(block_table_row + page, mask=in_seq, other=0).to(tl.int64)
        else:  # every key of the tile is in the sequence, so its page-table entry exists
            block = tl.load(block_table_row + page).to(tl.int64)
        k_rows = (block * stride_kc_b + offset * stride_kc_s)[:, None]
        v_rows = (block * stride_vc_b + offset * stride_vc_s)[:, None]
        k = _load_kv(k_base + k_rows + dims_kv_k, in_seq, dim_ok, MASKED, PADDED).to(q.dtype)  # fp8 -> fp16: exact
        v = _load_kv(v_base + v_rows + dims_kv_v, in_seq, v_dim_ok, MASKED, PADDED_V)
        if v.dtype == tl.float8e4nv:
            v = _widen_fp8_tile(v)
        v = v.to(q.dtype)

    s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
    if MASKED:
        visible = (keys[None, :] <= positions[:, None]) & in_seq[None, :]
        if USE_WINDOW:
            visible = visible & (positions[:, None] - keys[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))

    # Online softmax, in log2 units (qk_scale includes log2(e)) so the exponentials are exp2.
    # The running maximum m is kept scaled; s * qk_scale - m is then one fused multiply-add.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(s * qk_scale - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)  # rescales what was accumulated under the old maximum
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


# Per-step integers are not specialised: Triton compiles a separate binary for an int argument
# equal to 1 or divisible by 16, so a batch size or split count that changes every step would
# keep building variants (and hashing their cache keys) during a run.
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "num_q_tiles"])
def _unified_attention_kernel(
    num_q_tiles,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # out: final output, or split partials
    lse_ptr,  # split partials only: log2-sum-exp per row
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    k_scale_ptr,
    v_scale_ptr,  # fp8 cache: float32 scalars (stored * scale = value)
    num_reqs,
    num_splits,
    qk_scale,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,  # for splits: row = token * num_splits + split
    stride_lse_t,
    stride_lse_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    stride_bt,
    G: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # of q and K
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,  # of V and the output
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    ONE_TILE_PER_REQ: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
    FP8_DOTS_F16: tl.constexpr,  # fp8 cache, 16-bit query: dots in fp16
    NUM_KV_HEADS: tl.constexpr,
    SHORT_Q: tl.constexpr,  # > 0: one of a mixed batch's two launches (requests of <= SHORT_Q queries or the rest)
    TMA: tl.constexpr,  # q_ptr, k_cache_ptr, v_cache_ptr are tensor descriptors
):
    """One program: one query tile of one request, one KV head, one share of its keys.

    Work items (query tile, KV head) in a line on grid axis 0, heaviest first; split s of each on
    axis 1.

    A request's later query tiles see more keys (causal), so the line starts at the last tile slot:
    the GPU starts programs in grid order, so the long items start first and short ones fill the end,
    instead of long ones starting last while the other multiprocessors sit idle (longest processing
    time first). The KV heads of one tile are neighbours in the line.
    """
    work = tl.program_id(0)
    q_tile = num_q_tiles - 1 - work // NUM_KV_HEADS
    kv_head = work % NUM_KV_HEADS
    split = tl.program_id(1)

    # --- which request, which of its query tokens --------------------------------------------
    if ONE_TILE_PER_REQ:
        req = q_tile
        first = 0
    else:
        req = _find_request(query_start_loc_ptr, num_reqs, q_tile, BLOCK_Q)
        first = (q_tile - tl.load(query_start_loc_ptr + req) // BLOCK_Q - req) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    done = first >= query_len  # an unused tile slot (or a padded, empty request)
    if SHORT_Q > 0:  # a mixed batch's two launches: the one-tile launch takes the short requests
        if ONE_TILE_PER_REQ:
            done = done | (query_len > SHORT_Q)
        else:
            done = done | (query_len <= SHORT_Q)
    if done:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # the queries are the last query_len positions

    # Row m of the tile is query token first + m // G, query head kv_head * G + m % G.
    rows = tl.arange(0, BLOCK_M)
    q_local = first + rows // G
    heads = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (q_local < query_len)
    positions = context_len + q_local
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    tokens = (q_start + q_local).to(tl.int64)
    if TMA:  # q_ptr is a descriptor of q as [tokens, heads, head]: BLOCK_Q tokens x G heads, one box
        q = tl.reshape(q_ptr.load([q_start + first, kv_head * G, 0]), [BLOCK_M, HEAD_PAD])
    else:
        q = tl.load(
            q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
    if FP8_DOTS_F16:
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)

    # --- which key tiles ----------------------------------------------------------------------
    # Keys needed by some row: [p_first - window + 1, p_last]. Keys every row sees unmasked:
    # [p_last - window + 1, p_first]. Tiles wholly inside the second range skip the mask.
    p_first = context_len + first
    p_last = context_len + tl.minimum(first + BLOCK_Q, query_len) - 1
    tiles_end = tl.cdiv(p_last + 1, BLOCK_N)
    if USE_WINDOW:
        tiles_start = tl.maximum(p_first - sliding_window + 1, 0) // BLOCK_N
        full_start = tl.cdiv(tl.maximum(p_last - sliding_window + 1, 0), BLOCK_N)
    else:
        tiles_start = 0
        full_start = 0
    full_start = tl.minimum(tl.maximum(full_start, tiles_start), tiles_end)
    full_end = tl.minimum(tl.maximum((p_first + 1) // BLOCK_N, full_start), tiles_end)

    # This program's share of the tiles (all of them unless the keys are split).
    per_split = tl.cdiv(tiles_end - tiles_start, num_splits)
    mine_start = tiles_start + split * per_split
    mine_end = tl.minimum(mine_start + per_split, tiles_end)

    if FP8:  # dequantizing K scales every score: fold it into the softmax scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    v_dims = tl.arange(0, HEAD_PAD_V)
    v_dim_ok = v_dims < HEAD_SIZE_V
    acc = tl.zeros([BLOCK_M, HEAD_PAD_V], tl.float32)
    if TMA:  # k_cache_ptr / v_cache_ptr are tensor descriptors (see unified_attention)
        k_base, v_base, kv_col = k_cache_ptr, v_cache_ptr, kv_head * HEAD_SIZE
    else:
        k_base, v_base, kv_col = k_cache_ptr + kv_head * stride_kc_h, v_cache_ptr + kv_head * stride_vc_h, 0
    dims_k = (dims * stride_kc_d)[None, :]
    dims_v = (v_dims * stride_vc_d)[None, :]
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    if USE_WINDOW:  # tiles at the window's lower edge
        for tile in range(tl.maximum(tiles_start, mine_start), tl.minimum(full_start, mine_end)):
            acc, m_i, l_i = _attend_key_tile(
                acc,
                m_i,
                l_i,
                q,
                tile,
                k_base,
                v_base,
                kv_col,
                block_table_row,
                positions,
                seq_len,
                sliding_window,
                qk_scale,
                stride_kc_b,
                stride_kc_s,
                stride_vc_b,
                stride_vc_s,
                dims_k,
                dims_v,
                dim_ok,
                v_dim_ok,
                BLOCK_N,
                PAGE_SIZE,
                True,
                HEAD_PAD != HEAD_SIZE,
                HEAD_PAD_V != HEAD_SIZE_V,
                USE_WINDOW,
                DOT_PRECISION,
                UPCAST,
                TMA,
            )
    for tile in range(tl.maximum(full_start, mine_start), tl.minimum(full_end, mine_end)):
        acc, m_i, l_i = _attend_key_tile(
            acc,
            m_i,
            l_i,
            q,
            tile,
            k_base,
            v_base,
            kv_col,
            block_table_row,
            positions,
            seq_len,
            sliding_window,
            qk_scale,
            stride_kc_b,
            stride_kc_s,
            stride_vc_b,
            stride_vc_s,
            dims_k,
            dims_v,
            dim_ok,
            v_dim_ok,
            BLOCK_N,
            PAGE_SIZE,
            False,
            HEAD_PAD != HEAD_SIZE,
            HEAD_PAD_V != HEAD_SIZE_V,
            USE_WINDOW,
            DOT_PRECISION,
            UPCAST,
            TMA,
        )
    for tile in range(tl.maximum(full_end, mine_start), mine_end):  # the causal diagonal
        acc, m_i, l_i = _attend_key_tile(
            acc,
            m_i,
            l_i,
            q,
            tile,
            k_base,
            v_base,
            kv_col,
            block_table_row,
            positions,
            seq_len,
            sliding_window,
            qk_scale,
            stride_kc_b,
            stride_kc_s,
            stride_vc_b,
            stride_vc_s,
            dims_k,
            dims_v,
            dim_ok,
            v_dim_ok,
            BLOCK_N,
            PAGE_SIZE,
            True,
            HEAD_PAD != HEAD_SIZE,
            HEAD_PAD_V != HEAD_SIZE_V,
            USE_WINDOW,
            DOT_PRECISION,
            UPCAST,
            TMA,
        )

    # --- write back ---------------------------------------------------------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: output 0, weight exp2(-inf) = 0
    out = acc / l_safe[:, None]
    if FP8:  # dequantizing V scales the weighted sum (each split's alike, so the merge is unchanged)
        out = out * tl.load(v_scale_ptr)
    out_rows = tokens * num_splits + split
    tl.store(
        out_ptr + out_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + v_dims[None, :] * stride_o_d,
        out,
        mask=row_ok[:, None] & v_dim_ok[None, :],
    )
    if SPLIT_KV:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + out_rows * stride_lse_t + heads * stride_lse_h, lse, mask=row_ok)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    workspace: SplitKVWorkspace | None = None,
    config: KernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for a ragged batch; writes `out` and returns it.

    q: [num_tokens, num_q_heads, head_size]; k_cache: [num_blocks, block_size, num_kv_heads,
    head_size]; v_cache: the same with V's head size, usually head_size (MLA's prefill: K 192,
    V 128); out: [num_tokens, num_q_heads, V's head size]. Strided views are fine.
    query_start_loc: int32 [num_reqs + 1]; seq_lens: int32 [num_reqs] (context + query; a
    request's queries are its last positions); block_table: int32 [num_reqs, max_blocks]. A query
    at position p sees key k iff k <= p and, with a sliding window, p - k < sliding_window.

    `max_query_len` / `max_seq_len` are host-side upper bounds that choose the launch shape: a
    CUDA graph captured with them stays correct for any batch within them. `workspace` holds
    the split-KV scratch (allocated once by the metadata builder); without it, scratch is
    allocated per call. With a workspace the call does no allocation and no host sync.
    `config` overrides the tile heuristics (benchmarks, tuning). An fp8 cache (float8_e4m3fn)
    needs `k_scale` / `v_scale`, float32 scalar tensors: the cache holds K / k_scale, V / v_scale.
    """
    check_attention_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table)
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    check_kv_scales(fp8, k_scale, v_scale, k_cache.device)
    check_window(sliding_window)
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float (1 / sqrt(head_size), usually), got {softmax_scale!r}")
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads, head_size_v = k_cache.shape[2], v_cache.shape[3]
    check_pages_on_cpu(block_table, seq_lens, k_cache.shape[0], k_cache.shape[1])
    check_batch_on_cpu(query_start_loc, seq_lens, num_tokens, max_query_len, max_seq_len)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    num_reqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    head_pad, head_pad_v = next_power_of_2(head_size), next_power_of_2(head_size_v)
    if config is None:
        config = choose_config(  # tiles sized for the wider of K and V
            device=q.device,
            head_pad=max(head_pad, head_pad_v),
            dtype=q.dtype,
            num_queries_per_kv=group,
            num_kv_heads=num_kv_heads,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            kv_bytes=k_cache.element_size(),
        )
    if workspace is not None and num_tokens * config.num_splits > workspace.rows:
        # The scratch bounds num_tokens * num_splits: take fewer splits rather than overflow.
        config = dataclasses.replace(config, num_splits=max(workspace.rows // num_tokens, 1))
    # A mixed batch may run as two launches (`KernelConfig.short_rows`): first the requests of at most
    # `short_q` queries, one program each with decode tiles, then the rest with the main tiles.
    short_q = 0 if config.short_rows is None else config.short_rows.block_m // group
    for launch in (config,) if config.short_rows is None else (config.short_rows, config):
        block_q = launch.block_m // group
        if block_q < 1:
            raise ValueError(f"block_m={launch.block_m} is smaller than the {group} query heads per KV head")
        one_tile_per_req = block_q >= max_query_len or launch is config.short_rows
        if launch.num_splits > 1 and not one_tile_per_req:
            raise ValueError("split-KV needs every request's queries in one tile (a decode-like batch)")
        num_q_tiles = num_reqs if one_tile_per_req else num_tokens // block_q + num_reqs

        if launch.num_splits > 1:
            if workspace is None:
                workspace = SplitKVWorkspace(num_tokens * launch.num_splits, num_q_heads, head_size_v, q.device)
            elif tuple(workspace.partial_out.shape[1:]) != (num_q_heads, head_size_v):
                raise ValueError(
                    f"the split-KV workspace holds rows of {list(workspace.partial_out.shape[1:])} (heads, head size); "
                    f"this call writes [{num_q_heads}, {head_size_v}]: allocate it with the output's heads and head size"
                )
            partial_out, partial_lse = workspace.views(num_tokens, launch.num_splits)
            target, lse = partial_out, partial_lse
        else:
            target, lse = out, out  # lse is unused without splits

        descriptors = None if one_tile_per_req or not launch.tma else _tma_descriptors(q, k_cache, v_cache, launch)
        _unified_attention_kernel[(num_q_tiles * num_kv_heads, launch.num_splits)](
            num_q_tiles,
            *(descriptors or (q, k_cache, v_cache)),
            target,
            lse,
            query_start_loc,
            seq_lens,
            block_table,
            k_scale if fp8 else seq_lens,  # unread without fp8
            v_scale if fp8 else seq_lens,
            num_reqs,
            launch.num_splits,
            softmax_scale * LOG2_E,
            NO_WINDOW if sliding_window is None else sliding_window,
            *q.stride(),
            *target.stride(),
            *lse.stride()[:2],
            *k_cache.stride(),
            *v_cache.stride(),
            block_table.stride(0),
            G=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            HEAD_SIZE_V=head_size_v,
            HEAD_PAD_V=head_pad_v,
            BLOCK_M=launch.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=launch.block_n,
            PAGE_SIZE=k_cache.shape[1],
            SPLIT_KV=launch.num_splits > 1,
            ONE_TILE_PER_REQ=one_tile_per_req,
            USE_WINDOW=sliding_window is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=interpreting() and q.dtype == torch.bfloat16,
            FP8=fp8,
            FP8_DOTS_F16=fp8 and q.dtype != torch.float32,
            NUM_KV_HEADS=num_kv_heads,
            SHORT_Q=short_q,
            TMA=descriptors is not None,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **({} if launch.max_registers is None or interpreting() else {"maxnreg": launch.max_registers}),
        )
        if launch.num_splits > 1:
            merge_splits(partial_out, partial_lse, out, query_start_loc, launch.num_splits)
    return out


def _tma_descriptors(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, config: KernelConfig
) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors of q and of the K and V caches for a prefill launch's TMA copies, or None
    where the layout rules them out (the kernel then gathers with pointers). A K/V tile must lie in
    one page (page size a multiple of block_n: Hopper's TMA copies boxes, it cannot gather the
    pages of a random page table); a query tile must be exactly BLOCK_Q tokens x G heads, every head
    its power-of-two size; the caches hold q's dtype (an fp8 cache's tiles are cast after loading)
    with [blocks, page, heads, head] strides of whole slots."""
    num_tokens, num_q_heads, head = q.shape
    num_blocks, page, num_kv_heads, head_k = k_cache.shape
    group = num_q_heads // num_kv_heads
    if (
        k_cache.dtype != q.dtype
        or head & (head - 1)
        or v_cache.shape[3] != head
        or page % config.block_n
        or (config.block_m // group) * group != config.block_m
        or group & (group - 1)
        or q.stride(2) != 1
        or q.stride(1) != head
        or any(
            c.stride()[1:] != (num_kv_heads * head, head, 1) or c.stride(0) != page * c.stride(1)
            for c in (k_cache, v_cache)
        )
    ):
        return None
    slots = [num_blocks * page, num_kv_heads * head]
    try:
        return (
            TensorDescriptor(q, list(q.shape), list(q.stride()), [config.block_m // group, group, head]),
            TensorDescriptor(k_cache, slots, [k_cache.stride(1), 1], [config.block_n, head]),
            TensorDescriptor(v_cache, slots, [v_cache.stride(1), 1], [config.block_n, head]),
        )
    except AssertionError:  # a base address or row stride not 16-byte aligned
        return None
