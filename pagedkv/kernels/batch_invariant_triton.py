"""The CUDA kernels of the batch-invariant mode (pagedkv/batch_invariant.py says why):
a matmul with one tile shape for every M and no split-K, and an RMSNorm of one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.common import next_power_of_2

MatmulTiles = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the matmul."""

MATMUL_TILES: MatmulTiles = (128, 128, 64, 8, 3)
"""The matmul's tiles for every weight not in MATMUL_TILES_BY_SHAPE. One shape must serve decode
steps (M = the batch) and prefill chunks (M = thousands): of the candidates
benchmarks/batch_invariant_matmul.py timed on an H200 on llama3-8b's layers, this one had the
least W1-weighted time (0.56x cuBLAS at M = 128, 0.73x at M = 4,096, on 2026-12-04, before the
grouped program order and the unmasked K loop)."""

MATMUL_TILES_BY_SHAPE: dict[tuple[int, int], MatmulTiles] = {}
"""Tiles for particular weights, by (N, K) = (out features, in features): where MATMUL_TILES does not
suit a layer (a narrow weight leaves SMs idle at small M). Empty until an H200 run of
benchmarks/batch_invariant_matmul.py, whose per-shape table gives the entries; `end_to_end.py
--matmul-tiles` sets them from its JSON in-process. Keyed by the weight alone, never by M: a row's
sum runs in the same order whatever the batch. Fill it before an engine starts: its CUDA graphs keep
the tiles they captured, and a row computed with other tiles has other bits."""


def matmul_tiles(n: int, k: int) -> MatmulTiles:
    """The tiles of a weight [n, k]: its entry in MATMUL_TILES_BY_SHAPE, or MATMUL_TILES."""
    return MATMUL_TILES_BY_SHAPE.get((n, k), MATMUL_TILES)


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # One program = one [BLOCK_M, BLOCK_N] tile of y, summed over all of K in order (no split-K).
    # Programs run in groups of GROUP_M row tiles down one column of tiles, then the next column, so
    # that programs running at once share weight tiles in L2 (the order of programs changes no sum):
    #
    #   pid:   0  3  6 |  9 ...      (GROUP_M = 3)
    #          1  4  7 | 10
    #          2  5  8 | 11
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk
    m_ok, n_ok = rm[:, None] < M, rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
            w = tl.load(w_ptrs, mask=n_ok, other=0.0)
        else:
            k_ok = k0 + rk < K
            x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok
    )


def matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: tuple[int, ...] | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) with one tile shape for every M (`tiles`, default the
    weight's `matmul_tiles`)."""
    M, K = x.shape
    N = weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles or matmul_tiles(N, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    _matmul_kernel[(triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        M,
        N,
        K,
        *x.stride(),
        *weight.stride(),
        *y.stride(),
        HAS_BIAS=bias is not None,
        EVEN_K=K % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    # One program per row: the whole row in one block, reduced by tl.sum in one fixed order.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    # As the reference: normalise in float32, round to the input dtype, then scale by the weight.
    normed = (x * inv).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=cols < N)


def rms_norm_triton(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of `rows` [M, N] by one program, in the dtype the reference returns."""
    rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.promote_types(rows.dtype, weight.dtype), device=rows.device)
    if rows.shape[0]:
        n = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, y, n, eps, rows.stride(0), y.stride(0), BLOCK=next_power_of_2(n)
        )
    return y
