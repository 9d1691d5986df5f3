"""Dense causal prefill attention, built rung by rung (notebook 15).

Each rung is one function with the same signature, `rung(q, k, v, softmax_scale=None) -> out`, for
one sequence: q, k, v and out are [num_tokens, num_heads, head_dim], query t attends to keys 0..t.
Each rung keeps the one before it and adds one idea:

    0 naive             S = QK^T, softmax, P V: three kernels, S and P written to memory (O(T^2) bytes)
    1 tiled             FlashAttention-2: one program per (query tile, head), online softmax over key
                        tiles, never leaving registers; the key loop stops at the diagonal
    2 pipelined         the next tiles' loads issued while this one computes (num_stages=3), the softmax
                        scale folded into exp2, the key loop split into unmasked tiles and the diagonal
    3 descriptors       Q, K, V and O moved by tensor descriptors (Hopper's TMA engine: one
                        instruction per tile, no address arithmetic per element)
    4 warp_specialized  the key loop split between warps that load and warps that compute (asked
                        for; triton 3.6 does not do it on sm_90)

The tile sizes are the same on every rung, so each rung's speed-up comes from its own idea. The
paged kernel of notebook 06 (`unified_attention.py`) is rung 2 with a block table in its loads.
vLLM's dense prefill kernel, vllm/v1/attention/ops/triton_prefill_attention.py, is rung 1 with the
scale folded into exp2 (one program per request, head and query tile, the key loop cut at the
tile's end, num_stages=1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedkv.kernels.common import SUPPORTED_DTYPES, cdiv, check_tensors, interpreting, next_power_of_2
from pagedkv.kernels.unified_attention import LOG2_E, _dot

Rung = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Tiles:
    """The launch shape every rung shares."""

    block_m: int
    """Query rows per program (a multiple of block_n, so the diagonal is whole key tiles)."""
    block_n: int
    """Keys per step of the key loop."""
    num_warps: int


def choose_tiles(head_dim: int) -> Tiles:
    """Tiles of 16 under the interpreter (tiny tests, several tiles), Hopper-sized ones compiled."""
    if interpreting():
        return Tiles(16, 16, 4)
    # 128 queries x 64 keys: tiles whole for Hopper's tensor-core instructions (a warpgroup's wgmma
    # takes 64 rows), small enough that 3 stages of 16-bit K and V tiles of head 128 fit in shared
    # memory (3 * 2 * 64 * 128 * 2 bytes = 96 KB); 8 warps (two warpgroups) from a head of 128 up.
    return Tiles(128, 64, 8 if head_dim >= 128 else 4)


def causal_flops(num_tokens: int, num_heads: int, head_dim: int) -> float:
    """The useful work of causal attention: QK^T and PV, 2 * T * T * D multiply-adds each per head,
    half of them under the causal mask (FlashAttention's count, so TFLOP/s compare across kernels)."""
    return 4.0 * num_heads * num_tokens * num_tokens * head_dim / 2


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """What every rung computes, in float64 torch: out[t] = softmax(scale * q[t] . k[:t + 1]) @ v[:t + 1]."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    future = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).triu(1)
    return torch.einsum("hts,shd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


# --- shared pieces --------------------------------------------------------------------------------


@triton.jit
def _tile_offsets(rows, head, stride_t, stride_h, HEAD_DIM: tl.constexpr):
    """Element offsets of a [rows, HEAD_DIM] tile of one head (int64: T * H * D may pass 2^31)."""
    dims = tl.arange(0, HEAD_DIM)
    return rows.to(tl.int64)[:, None] * stride_t + head * stride_h + dims[None, :]


@triton.jit
def _load_tile(ptr, rows, head, stride_t, stride_h, num_tokens, HEAD_DIM: tl.constexpr):
    """A [rows, HEAD_DIM] tile of one head; rows past the sequence read as 0, a finite value for
    the dots (0 x NaN would poison a whole row), whose results for them are masked or not stored."""
    offsets = _tile_offsets(rows, head, stride_t, stride_h, HEAD_DIM)
    return tl.load(ptr + offsets, mask=(rows < num_tokens)[:, None], other=0.0)


@triton.jit
def _store_tile(ptr, tile, rows, head, stride_t, stride_h, num_tokens, HEAD_DIM: tl.constexpr):
    """Store a [rows, HEAD_DIM] tile of one head, the rows past the sequence left out."""
    tl.store(ptr + _tile_offsets(rows, head, stride_t, stride_h, HEAD_DIM), tile, mask=(rows < num_tokens)[:, None])


@triton.jit
def _online_softmax_exp2(acc, m_i, l_i, s, v, qk_scale, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one key tile's raw scores `s` and values `v` into the running (acc, m, l), in base 2.

    `qk_scale` holds softmax_scale * log2(e): exp(x * scale) = exp2(x * qk_scale), and the scale
    enters the fused multiply-add s * qk_scale - m instead of a multiply of its own. Every row has
    seen key 0 by its first tile, so m is finite here and no -inf - -inf can make NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old maximum
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


# --- rung 0: naive --------------------------------------------------------------------------------


@triton.jit
def _naive_scores_kernel(
    q_ptr, k_ptr, s_ptr, scale, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_sh, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """S[head, rows, keys] = scale * Q K^T for one tile, -inf above the diagonal."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(2)
    q = _load_tile(q_ptr, rows, head, stride_qt, stride_qh, num_tokens, HEAD_DIM)
    k = _load_tile(k_ptr, keys, head, stride_kt, stride_kh, num_tokens, HEAD_DIM)
    s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
    s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
    out = s_ptr + head.to(tl.int64) * stride_sh + rows[:, None] * stride_st + keys[None, :]
    tl.store(out, s, mask=(rows < num_tokens)[:, None] & (keys < num_tokens)[None, :])


@triton.jit
def _naive_softmax_kernel(s_ptr, num_tokens, stride_sh, stride_st, BLOCK_T: tl.constexpr):
    """One row of S replaced by its softmax P, in place: the whole row is read and written again."""
    keys = tl.arange(0, BLOCK_T)
    row = s_ptr + tl.program_id(1).to(tl.int64) * stride_sh + tl.program_id(0) * stride_st + keys
    s = tl.load(row, mask=keys < num_tokens, other=float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    tl.store(row, p / tl.sum(p, 0), mask=keys < num_tokens)


@triton.jit
def _naive_pv_kernel(
    p_ptr, v_ptr, o_ptr, num_tokens,
    stride_sh, stride_st, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """O = P V for one tile of rows, reading every key's P, the zeros above the diagonal too."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, num_tokens, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        p_tile = p_ptr + head.to(tl.int64) * stride_sh + rows[:, None] * stride_st + keys[None, :]
        p = tl.load(p_tile, mask=(rows < num_tokens)[:, None] & (keys < num_tokens)[None, :], other=0.0)
        v = _load_tile(v_ptr, keys, head, stride_vt, stride_vh, num_tokens, HEAD_DIM)
        acc += _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    _store_tile(o_ptr, acc, rows, head, stride_ot, stride_oh, num_tokens, HEAD_DIM)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Rung 0: attention as the formula reads, S = scale * Q K^T, P = softmax(S), O = P V, in three
    kernels. S and P live in memory, float32 [heads, T, T]: T = 8192 with 32 heads is 8.6 GB written
    by the first kernel, read and written by the second and read by the third, against 0.2 GB of
    q, k, v and out. The rungs after it never write a score."""
    scale, tiles, dot = _prepare(q, k, v, softmax_scale)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    scores = torch.empty(num_heads, num_tokens, num_tokens, dtype=torch.float32, device=q.device)
    m_tiles, n_tiles = cdiv(num_tokens, tiles.block_m), cdiv(num_tokens, tiles.block_n)
    sizes = dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **dot)
    _naive_scores_kernel[(m_tiles, n_tiles, num_heads)](
        q, k, scores, scale, num_tokens, *q.stride()[:2], *k.stride()[:2], *scores.stride()[:2],
        **sizes, num_warps=tiles.num_warps,
    )  # fmt: skip
    # One program holds a whole row of S; its warps grow with it (8192 values on 16 warps: 16 a thread).
    block_t = next_power_of_2(num_tokens)
    _naive_softmax_kernel[(num_tokens, num_heads)](
        scores, num_tokens, *scores.stride()[:2], BLOCK_T=block_t, num_warps=min(max(block_t // 512, 4), 16)
    )
    _naive_pv_kernel[(m_tiles, num_heads)](
        scores, v, out, num_tokens, *scores.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        **sizes, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


# --- rung 1: tiled (FlashAttention-2) -------------------------------------------------------------


@triton.jit
def _tiled_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, scale, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M queries of one head against every key tile up to the diagonal."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(q_ptr, rows, head, stride_qt, stride_qh, num_tokens, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: no query of this tile sees a key past its last row, so those tiles are never loaded.
    for start_n in range(0, tl.minimum(start_m + BLOCK_M, num_tokens), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_ptr, keys, head, stride_kt, stride_kh, num_tokens, HEAD_DIM)
        v = _load_tile(v_ptr, keys, head, stride_vt, stride_vh, num_tokens, HEAD_DIM)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
        s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))  # every tile pays for the mask
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is in every row's first tile
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new
    _store_tile(o_ptr, acc / l_i[:, None], rows, head, stride_ot, stride_oh, num_tokens, HEAD_DIM)


def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Rung 1: FlashAttention-2. A program owns BLOCK_M queries of one head and walks the key tiles
    with an online softmax (running max m, sum l, unnormalised acc), so scores never leave
    registers: memory traffic drops from O(T^2) to reading K and V once per query tile. Causal
    tiles past the diagonal are skipped, half the work. `num_stages=1`: each tile's loads wait
    for the tile before them to finish computing."""
    scale, tiles, dot = _prepare(q, k, v, softmax_scale)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    _tiled_kernel[(cdiv(num_tokens, tiles.block_m), num_heads)](
        q, k, v, out, scale, num_tokens, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **dot,
        num_warps=tiles.num_warps, num_stages=1,
    )  # fmt: skip
    return out


# --- rung 2: pipelined ----------------------------------------------------------------------------

NUM_STAGES = 3
"""Tiles in flight in the pipelined key loops: one computed while the next two load."""


@triton.jit
def _pipelined_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Rung 1's program, its key loop in two pipelined parts: below the diagonal, then on it."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(q_ptr, rows, head, stride_qt, stride_qh, num_tokens, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys before start_m: every query of the tile sees them all, and they are all in the sequence
    # (start_m < num_tokens), so these tiles load and score with no mask.
    for start_n in tl.range(0, start_m, BLOCK_N, num_stages=NUM_STAGES):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + _tile_offsets(keys, head, stride_kt, stride_kh, HEAD_DIM))
        v = tl.load(v_ptr + _tile_offsets(keys, head, stride_vt, stride_vh, HEAD_DIM))
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        acc, m_i, l_i = _online_softmax_exp2(acc, m_i, l_i, s, v, qk_scale, DOT_PRECISION, UPCAST)
    # The diagonal: BLOCK_M // BLOCK_N tiles that need the causal mask (and the sequence's end).
    for start_n in tl.range(start_m, tl.minimum(start_m + BLOCK_M, num_tokens), BLOCK_N, num_stages=NUM_STAGES):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_ptr, keys, head, stride_kt, stride_kh, num_tokens, HEAD_DIM)
        v = _load_tile(v_ptr, keys, head, stride_vt, stride_vh, num_tokens, HEAD_DIM)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_exp2(acc, m_i, l_i, s, v, qk_scale, DOT_PRECISION, UPCAST)
    _store_tile(o_ptr, acc / l_i[:, None], rows, head, stride_ot, stride_oh, num_tokens, HEAD_DIM)


def pipelined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Rung 2: rung 1 with its key loop software-pipelined (`tl.range(..., num_stages=3)`: the loads
    of the next tiles are in flight while this one computes, so the tensor cores do not wait on
    memory), the scale folded into exp2 (one fused multiply-add per score instead of a multiply and
    an exp), and the causal loop split: the tiles below the diagonal run without any mask, only
    the BLOCK_M // BLOCK_N tiles on it pay for one."""
    scale, tiles, dot = _prepare(q, k, v, softmax_scale)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    _pipelined_kernel[(cdiv(num_tokens, tiles.block_m), num_heads)](
        q, k, v, out, scale * LOG2_E, num_tokens,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_STAGES=NUM_STAGES, **dot,
        num_warps=tiles.num_warps, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


# --- rungs 3 and 4: tensor descriptors, then warp specialization ----------------------------------


@triton.jit
def _descriptor_kernel(
    q_desc, k_desc, v_desc, o_desc, qk_scale, num_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Rung 2's program with every tile moved by a descriptor of the [T, H * D] rows: a tile is
    (first row, head * HEAD_DIM); rows past T load as zeros and are not stored."""
    start_m = tl.program_id(0) * BLOCK_M
    col = tl.program_id(1) * HEAD_DIM
    rows = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, col])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, start_m, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, col])
        v = v_desc.load([start_n, col])
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        acc, m_i, l_i = _online_softmax_exp2(acc, m_i, l_i, s, v, qk_scale, DOT_PRECISION, UPCAST)
    diagonal_end = tl.minimum(start_m + BLOCK_M, num_tokens)
    for start_n in tl.range(start_m, diagonal_end, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, col])  # keys past T are zeros, and the causal mask hides them
        v = v_desc.load([start_n, col])
        keys = start_n + tl.arange(0, BLOCK_N)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_exp2(acc, m_i, l_i, s, v, qk_scale, DOT_PRECISION, UPCAST)
    o_desc.store([start_m, col], (acc / l_i[:, None]).to(o_desc.dtype))


def _descriptor_rung(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, warp_specialize: bool
) -> torch.Tensor:
    """Rungs 3 and 4: one kernel, `warp_specialize` the only difference."""
    scale, tiles, dot = _prepare(q, k, v, softmax_scale)
    num_tokens, num_heads, head_dim = q.shape
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(1) != head_dim or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
            raise ValueError(
                f"{name} has strides {tuple(x.stride())}: a tensor descriptor needs each token's heads packed in "
                f"one row (strides (n, {head_dim}, 1), n * {x.element_size()} bytes a multiple of 16) and a "
                "16-byte aligned start, e.g. x.contiguous()"
            )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)

    def rows_of(x: torch.Tensor, block: int) -> TensorDescriptor:
        # The [T, H, D] tensor as T rows of H * D values; one tile is [block, D] of one head.
        return TensorDescriptor(x, [num_tokens, num_heads * head_dim], [x.stride(0), 1], [block, head_dim])

    _descriptor_kernel[(cdiv(num_tokens, tiles.block_m), num_heads)](
        rows_of(q, tiles.block_m), rows_of(k, tiles.block_n), rows_of(v, tiles.block_n), rows_of(out, tiles.block_m),
        scale * LOG2_E, num_tokens,
        HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_STAGES=NUM_STAGES,
        WARP_SPECIALIZE=warp_specialize, **dot, num_warps=tiles.num_warps, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Rung 3: rung 2 with tensor descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`,
    made on the host). On Hopper a descriptor load is one TMA instruction that copies a whole tile
    into shared memory, bounds included (rows past T read as zeros, and are not stored): no
    per-element pointers or masks in registers, and the copy engine works while the warps compute."""
    return _descriptor_rung(q, k, v, softmax_scale, warp_specialize=False)


def warp_specialized(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None
) -> torch.Tensor:
    """Rung 4: rung 3 with `tl.range(..., warp_specialize=True)` on the key loops: the compiler gives
    the TMA loads to a producer warp and the dots and softmax to consumer warps, which hand tiles
    over through shared-memory barriers, so loading never waits on computing. Whether Triton does
    this on Hopper depends on its version: triton 3.6 accepts the flag for sm_90 and compiles rung 3's
    kernel (no warp-specialized partition in its TTGIR; on an H100 both time within 1%). Its
    interpreter ignores the flag."""
    return _descriptor_rung(q, k, v, softmax_scale, warp_specialize=True)


RUNGS: dict[str, Rung] = {
    "naive": naive,
    "tiled": tiled,
    "pipelined": pipelined,
    "descriptors": descriptors,
    "warp_specialized": warp_specialized,
}
"""The ladder, in order: rung name -> function(q, k, v, softmax_scale=None)."""


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None
) -> tuple[float, Tiles, dict[str, object]]:
    """Check the inputs; (the softmax scale, the tiles, the dot's compile-time arguments)."""
    check_tensors(q=q, k=k, v=v)
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must all be [num_tokens, num_heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: use one of {list(SUPPORTED_DTYPES)}")
    num_tokens, _, head_dim = q.shape
    if head_dim not in (16, 32, 64, 128):  # powers of two for the tiles; 3 stages of 128 fit shared memory
        raise ValueError(f"head_dim {head_dim} is not supported: the ladder's tiles need 16, 32, 64 or 128")
    if num_tokens == 0:
        raise ValueError("q has no tokens: a prefill needs num_tokens >= 1")
    if any(x.stride(2) != 1 for x in (q, k, v)):
        raise ValueError(
            f"the head dim must be contiguous (stride 1); strides {q.stride()}, {k.stride()}, {v.stride()}"
        )
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float (1 / sqrt(head_dim), usually), got {softmax_scale!r}")
    dot: dict[str, object] = dict(
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # 16-bit inputs: ignored
        UPCAST=interpreting() and q.dtype == torch.bfloat16,
    )
    return float(softmax_scale), choose_tiles(head_dim), dot
