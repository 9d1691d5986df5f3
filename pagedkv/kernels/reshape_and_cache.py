"""Scatter this step's keys and values into the paged KV cache.

The one idea: a token's cache address is a single integer, its *slot*
(`physical_block * block_size + offset_in_block`, computed by the model runner). So writing
the cache is a scatter: token `t` of `key` goes to `k_cache[slot // block_size,
slot % block_size]`, and likewise for `value`. One Triton program moves one token (all of its
KV heads, K and V), which is a few kilobytes of contiguous memory on each side: plenty for
wide, coalesced loads and stores. Slot -1 marks a padding token (CUDA-graph padding, say):
its program returns without touching the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.common import check_attention_dtype, check_tensors, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], any strides
    slot_mapping_ptr,  # [num_tokens], int32 or int64, -1 = skip
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
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` [num_tokens, num_kv_heads, head_size] into their cache slots.

    `k_cache`/`v_cache` are [num_blocks, block_size, num_kv_heads, head_size], possibly strided
    views (e.g. `kv_cache[0]` and `kv_cache[1]` of the `(2, num_blocks, ...)` layout).
    `slot_mapping` (int32 or int64) has one slot per token; -1 skips the token. Only the first
    `slot_mapping.shape[0]` tokens are written, so `key` may carry extra padding rows.
    No host synchronisation: safe inside a CUDA graph.
    """
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
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
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
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
    check_attention_dtype(k_cache.dtype, "k_cache")
