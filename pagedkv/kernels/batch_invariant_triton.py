"""The CUDA kernels of the batch-invariant mode (pagedkv/batch_invariant.py says why):
a matmul whose K loop is the same for every M (no split-K), and an RMSNorm of one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.common import by_size, next_power_of_2

MatmulTiles = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the matmul."""

MATMUL_BLOCK_K = 64
"""K per step of the loop in every tile the mode picks: each output element is then summed over
the same chunks of K in the same order (k = 0..63, then 64..127, ...) whatever the tile's other sides."""

MATMUL_TILES_BY_M: tuple[tuple[int | None, MatmulTiles], ...] = (
    (32, (64, 32, 64, 4, 4)),
    (256, (64, 128, 64, 4, 4)),
    (None, (128, 128, 64, 8, 3)),
)
"""The matmul's tiles by M (the rows of the call): (largest M, tiles) buckets, in order.

One tile for every M (vllm/model_executor/layers/batch_invariant.py) gives a 4,096-wide weight 32
programs at a decode step, for 132 SMs: most of the bandwidth idles. A decode's few rows want
narrow tiles and many programs, a prefill chunk's thousands the widest tiles. Every entry has
BLOCK_K = MATMUL_BLOCK_K and no split-K, so a row's sums run in the same order in each; only the
tensor-core instructions that compute them differ, and they give the same bits only as far as
tests/gpu/test_batch_invariant_cuda.py shows on the GPU, for every entry (MATMUL_TILE_CHOICES).
That test is what allows tiles to follow M: an entry that fails it must leave the table.
benchmarks/batch_invariant_matmul.py times the candidates per bucket."""

MATMUL_TILE_CHOICES: tuple[MatmulTiles, ...] = tuple(dict.fromkeys(tiles for _, tiles in MATMUL_TILES_BY_M))
"""Every tile shape the mode can pick for a weight without an entry in MATMUL_TILES_BY_SHAPE: the
set whose outputs tests/gpu must find bitwise equal."""

MATMUL_TILES_BY_SHAPE: dict[tuple[int, int], MatmulTiles] = {}
"""One tile for every M of a particular weight, by (N, K) = (out features, in features), in place
of MATMUL_TILES_BY_M: a row of such a weight never changes tiles, so its bits need no GPU
agreement between tiles. Empty: `end_to_end.py --matmul-tiles` fills it in-process from a
benchmarks/batch_invariant_matmul.py JSON, to try per-weight winners. Fill it before an engine
starts: its CUDA graphs keep the tiles they captured."""


def matmul_tiles(m: int, n: int, k: int) -> MatmulTiles:
    """The tiles of x [m, k] @ weight [n, k].T: the weight's MATMUL_TILES_BY_SHAPE entry, or M's bucket."""
    return MATMUL_TILES_BY_SHAPE.get((n, k)) or by_size(MATMUL_TILES_BY_M, m)


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
    """x [M, K] @ weight[N, K].T (+ bias), each output tile summed over K by one program in BLOCK_K
    chunks, in order (`tiles`, default `matmul_tiles(M, N, K)`)."""
    M, K = x.shape
    N = weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles or matmul_tiles(M, N, K)
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
