"""An FP8 (e4m3) KV cache: one byte per cached value instead of two, with a scale per layer.

What e4m3 can hold: 1 sign bit, 4 exponent bits, 3 mantissa bits (torch.float8_e4m3fn: "fn", no
infinities, one NaN pattern). Its largest value is 448 = 1.75 x 2^8, its smallest normal 2^-6 and
its smallest subnormal 2^-9. Three mantissa bits put 8 values in each power of two, so a rounded
value is within 1/16 (6.25%) of the original, relatively, anywhere in the normal range.

Why a scale: the float format already adapts to magnitude, so precision is not the issue; range is.
A K of 1,000 would saturate at 448, and values below 2^-6 lose their relative precision. So each
layer stores `x / scale` and reads `stored * scale`, one float32 scale for its K and one for its V
(vLLM's Attention._k_scale / _v_scale). As in vLLM they are 1.0 unless given (`kv_cache_scales`) or
computed (`calculate_kv_scales=True`, vllm/config/cache.py). Computed from the profile run's K and V,
scale = amax / 200 for K (amax / 100 for V: vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT,
vllm/envs.py) puts the largest value that run saw at 200 (100), leaving 2.2x (4.5x) headroom below
448 for larger values later (vllm/attention/layer.py, calc_kv_scales). That run's batch is
max_num_batched_tokens synthetic tokens, so computed scales, and the outputs, change with that budget.

Bytes per token and layer: 2 (K and V) x num_kv_heads x head_size x 1 byte, half of bf16's: the
same memory holds twice the blocks, and a decode, which reads the whole cache every step, reads
half the bytes.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448.0: quantizing saturates here (a plain cast of a larger float would give NaN)."""

K_SCALE_CONSTANT = 200.0
"""Where a computed K scale puts the profile run's K amax (vLLM's K_SCALE_CONSTANT)."""
V_SCALE_CONSTANT = 100.0
"""Where a computed V scale puts the profile run's V amax (vLLM's V_SCALE_CONSTANT)."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype stores quantized values (and so needs scales)."""
    return dtype == torch.float8_e4m3fn


def kv_scale(x: torch.Tensor, range_constant: float) -> torch.Tensor:
    """amax(|x|) / range_constant as a float32 scalar on x's device (1.0 for an all-zero x, where
    any scale is exact). No host synchronisation."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax > 0, amax / range_constant, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to +-448, rounded to the nearest e4m3 value (ties to even)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale, in `dtype` (the product is computed in float32, or in `dtype` if wider)."""
    compute = torch.promote_types(dtype, torch.float32)
    return (x.to(compute) * scale).to(dtype)
