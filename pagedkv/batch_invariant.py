"""Batch-invariant matmul, RMSNorm and (log-)softmax: a row's result never depends on the other rows.

Why one prompt's logits change with its batch, although every row is computed on its own: a
floating-point sum depends on its order, and the order is chosen from the *whole* problem's shape.

    y[m, :] = x[m, :] @ W         cuBLAS picks a kernel for (M, N, K): tile 64x128 or 128x256,
                                  split-K in 2 or 4 (partial sums added at the end), ... so the
                                  K-sum of row m runs in another order when M changes.
    rms(x[m, :]), softmax(...)    a reduction kernel picks how many threads share one row from
                                  the number of rows; more rows, fewer threads per row.

The cure (vllm/model_executor/layers/batch_invariant.py; Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025) is to fix every such choice independently of the batch:

    matmul    one K loop for every M: each output tile reduced over all of K by one program, in
              chunks of the same BLOCK_K taken in the same order (no split-K).
    RMSNorm   one program per row, the row's sum in one fixed order.
    softmax   the same, per row.

vLLM's kernel keeps one tile shape for every M as well. Here the tile's other sides (BLOCK_M,
BLOCK_N, warps, stages) follow M (`MATMUL_TILES_BY_M` in pagedkv/kernels/batch_invariant_triton.py:
narrow tiles, many programs, for a decode's few rows), and so do the attention's query-row tiles
(`batch_invariant_config` in pagedkv/kernels/attention_config.py). They change which tensor-core
instructions compute a row, not the order of its sums, and a row keeps its bits only because the
hardware gives every such tile the same bits: tests/gpu/test_batch_invariant_cuda.py checks this
for every tile the mode can pick, and a tile that fails it leaves the tables.

On CUDA, matmul and RMSNorm are the Triton kernels of pagedkv/kernels/batch_invariant_triton.py. On the CPU (and
under TRITON_INTERPRET, whose programs run one by one in numpy) the same idea is applied to torch's
own kernels: rows go in blocks of `ROWS`, so every library call sees the same shape, whatever the
batch; the sampler's softmax, log-softmax and top-p sums do so on every device:

    x [M, K]  ->  pad to a multiple of ROWS  ->  [ROWS, K] @ W.T  for each block  ->  y [M, N]

Slower (a call per block), but exactly as the tests check: a row's bits no longer depend on M.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedkv.library import register_op

ROWS = 16
"""Rows per library call on the CPU path: every call sees [ROWS, ...]."""


def _use_triton(x: torch.Tensor) -> bool:
    """CUDA runs the kernels of pagedkv/kernels/batch_invariant_triton.py. Imported only then: this
    module, which the models import, must not import Triton (on the CPU its interpreter is switched
    on by the environment before Triton's first import; notebook 06 does so late)."""
    if not x.is_cuda:
        return False
    from pagedkv.kernels.common import interpreting

    return not interpreting()


def row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to `x` ([rows, ...]) in blocks of ROWS rows, the last one zero-padded: every call
    has the same shape, so torch picks the same kernel (and summation order) for every batch."""
    rows = x.shape[0]
    padded = -(-rows // ROWS) * ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])
    return torch.cat([fn(block) for block in x.split(ROWS)])[:rows]


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, K] @ weight.T (+ bias), each row on its own: the body of `pagedkv::invariant_linear`."""
    if _use_triton(x):
        from pagedkv.kernels.batch_invariant_triton import matmul_triton

        return matmul_triton(x, weight, bias)
    return row_blocks(lambda block: F.linear(block, weight, bias), x)


def _linear_rows_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every output row is bitwise the same whatever the other rows (x [..., K])."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():  # traced: the opaque op (see the registration below)
        y = torch.ops.pagedkv.invariant_linear(rows, weight, bias)
    else:  # run eagerly: the body itself, without the dispatcher's ~3 us a call
        y = _linear_rows(rows, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, normalised in float32 (the formula of transformers' LlamaRMSNorm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` of x [rows, N], each row on its own: the body of `pagedkv::invariant_rms_norm`."""
    if _use_triton(x):
        from pagedkv.kernels.batch_invariant_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return row_blocks(lambda block: rms_norm_reference(block, weight, eps), x)


def _rms_norm_rows_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference`, each row reduced on its own in a fixed order (x [..., N])."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.pagedkv.invariant_rms_norm(rows, weight, eps)
    else:
        y = _rms_norm_rows(rows, weight, eps)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# Opaque to torch.compile (pagedkv/library.py): traced around, never into, so Inductor cannot swap
# the fixed-order kernels for its own, tiled by the batch. Only elementwise work (residual adds,
# SiLU, RoPE) is left for it to fuse, and an elementwise result does not depend on the batch.
# Eager code calls the bodies directly, as the attention layer does (`Attention.use_direct_call`).
register_op("invariant_linear", _linear_rows, _linear_rows_fake, mutates_args=())
register_op("invariant_rms_norm", _rms_norm_rows, _rms_norm_rows_fake, mutates_args=())
