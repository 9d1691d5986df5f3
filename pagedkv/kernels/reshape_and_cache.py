"""Scatter this step's keys and values into the paged KV cache.

The one idea: a token's cache address is a single integer, its *slot*
(`physical_block * block_size + offset_in_block`, computed by the model runner). So writing
the cache is a scatter: token `t` of `key` goes to `k_cache[slot // block_size,
slot % block_size]`, and likewise for `value`. One Triton program moves one token (all of its
KV heads, K and V), which is a few kilobytes of contiguous memory on each side: plenty for
wide, coalesced loads and stores. Slot -1 marks a padding token (CUDA-graph padding, say):
its program returns without touching the cache.

An fp8 (e4m3) cache stores `x / scale` saturated to +-448, one byte per value, with one float32
scale for K and one for V (pagedkv/kv_cache/fp8.py says why): the same scatter, one division and
a cast more (vLLM: reshape_and_cache_flash's kv_cache_dtype "fp8", csrc/cache_kernels.cu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.common import check_attention_dtype, check_tensors, interpreting, next_power_of_2

FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
"""Cache dtypes stored quantized (x / scale); tl.float8e4nv is e4m3fn on the GPU and in the interpreter."""


@triton.jit
def _round_to_e4m3(y):
    """y (float32, within +-448) rounded to the nearest e4m3 value, ties to even, still float32.

    Works around Triton's CPU interpreter (triton 3.9), whose float -> fp8 cast rounds a mantissa
    up without carrying into the exponent (0.0309 becomes 0.0156, not 0.03125); values already on
    the e4m3 grid it casts exactly. The GPU's cast (cvt.rn.satfinite) needs none of this.
    Normal range: keep 3 of float32's 23 mantissa bits (add half an e4m3 step, plus one for ties
    to even, and clear the rest: a carry moves into the exponent as it should). Below 2^-6 the
    e4m3 step is fixed at 2^-9: shift by 2^-6 into the binade whose step that is, round, shift back.
    """
    a = tl.abs(y)
    sub = a < 0.015625
    a = tl.where(sub, a + 0.015625, a)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    r = bits.to(tl.float32, bitcast=True)
    r = tl.where(sub, r - 0.015625, r)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, scale, FP8_MAX: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """x / scale saturated to +-FP8_MAX, in float32 (the store casts it to the cache's fp8)."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
    if SOFT_ROUND:
        y = _round_to_e4m3(y)
    return y


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], any strides
    slot_mapping_ptr,  # [num_tokens], int32 or int64, -1 = skip
    k_scale_ptr,
    v_scale_ptr,  # float32 scalars (fp8 cache only)
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS (tile shapes must be powers of 2)
    HEAD_PAD: tl.constexpr,  # next power of two of HEAD_SIZE
    FP8: tl.constexpr,  # quantize into an fp8 cache
    FP8_MAX: tl.constexpr,
    SOFT_ROUND: tl.constexpr,  # round to e4m3 in software (the interpreter's cast rounds wrongly)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to write
    block = slot // block_size
    offset = slot % block_size

    # One [heads, head_size] tile per tensor; padding lanes are masked off. Masked lanes are never
    # stored or computed with, so the loads need no `other`.
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    token64 = token.to(tl.int64)

    k = tl.load(key_ptr + token64 * stride_key_t + heads * stride_key_h + dims * stride_key_d, mask=mask)
    v = tl.load(value_ptr + token64 * stride_value_t + heads * stride_value_h + dims * stride_value_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h + dims * stride_kc_d
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h + dims * stride_vc_d
    if FP8:
        k = _quantize(k, tl.load(k_scale_ptr), FP8_MAX, SOFT_ROUND)
        v = _quantize(v, tl.load(v_scale_ptr), FP8_MAX, SOFT_ROUND)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` [num_tokens, num_kv_heads, head_size] into their cache slots.

    `k_cache`/`v_cache` are [num_blocks, block_size, num_kv_heads, head_size], possibly strided
    views (e.g. `kv_cache[0]` and `kv_cache[1]` of the `(2, num_blocks, ...)` layout).
    `slot_mapping` (int32 or int64) has one slot per token; -1 skips the token. Only the first
    `slot_mapping.shape[0]` tokens are written, so `key` may carry extra padding rows.
    An fp8 cache (float8_e4m3fn) takes `k_scale` / `v_scale`, float32 scalar tensors, and stores
    `key / k_scale` and `value / v_scale` saturated to +-448.
    No host synchronisation: safe inside a CUDA graph.
    """
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    check_kv_scales(fp8, k_scale, v_scale, k_cache.device)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # unread without fp8
        v_scale if fp8 else slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
        FP8=fp8,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        SOFT_ROUND=fp8 and interpreting(),
        num_warps=4,
    )


def _check_shapes(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_tensors(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_size]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_size]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head size {tuple(k_cache.shape[2:])} do not match key {tuple(key.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be a 1-D int32/int64 tensor; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots but key only {key.shape[0]} tokens")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    # Where it is free (CPU tensors, see check_pages_on_cpu): a slot past the cache is a segfault there.
    if (
        slot_mapping.device.type == "cpu"
        and slot_mapping.numel()
        and (slot_mapping.min() < -1 or slot_mapping.max() >= num_slots)
    ):
        raise ValueError(
            f"slot_mapping must hold slots in [0, {num_slots}) or -1 (skip), got values from "
            f"{slot_mapping.min().item()} to {slot_mapping.max().item()}"
        )
    check_attention_dtype(key.dtype, "key")
    if k_cache.dtype not in FP8_CACHE_DTYPES:
        check_attention_dtype(k_cache.dtype, "k_cache")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")


def check_kv_scales(
    fp8: bool, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> None:
    """An fp8 cache needs both scales, float32 scalars on the cache's device; another cache none."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale are for an fp8 KV cache; this cache stores the model dtype as it is")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"an fp8 KV cache needs {name} as a float32 tensor of one element, got {scale!r}")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device}, the KV cache on {device}")
