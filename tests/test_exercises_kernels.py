"""The kernel exercises' checkers accept a right answer and explain a wrong one."""

from __future__ import annotations

import pytest

import pagedkv.kernels as K
from pagedkv.exercises.kernels import check_kernel_block_row, check_scatter_kernel

if not K.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scatter(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_t, stride_b, stride_s, stride_h,
             block_size, HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, SKIP_PADDING: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if SKIP_PADDING:
        if slot < 0:
            return
    slot = tl.maximum(slot, 0)  # the "forgot padding" variant writes token -1 into slot 0
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_SIZE)[None, :]
    src = token * stride_t + heads * HEAD_SIZE + dims
    dst = (slot // block_size) * stride_b + (slot % block_size) * stride_s + heads * stride_h + dims
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + src))
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + src))


def _launcher(skip_padding: bool):
    def launch(key, value, k_cache, v_cache, slots):
        _scatter[(slots.shape[0],)](key, value, k_cache, v_cache, slots, key.stride(0), k_cache.stride(0),
                                    k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
                                    HEADS=key.shape[1], HEAD_SIZE=key.shape[2], SKIP_PADDING=skip_padding)
    return launch


def test_scatter_checker_accepts_reference_kernel() -> None:
    assert check_scatter_kernel(K.reshape_and_cache).ok
    assert check_scatter_kernel(_launcher(skip_padding=True)).ok


def test_scatter_checker_catches_padding_writes() -> None:
    result = check_scatter_kernel(_launcher(skip_padding=False))
    # The padding token lands in slot 0. If a real token owns slot 0 too, which write wins is a
    # race on a GPU, so the checker may report either the clobbered token or the stray write.
    assert not result.ok
    assert "slot -1" in result.message or "does not hold its" in result.message


def test_scatter_checker_catches_torch_mistake() -> None:
    def wrong(key, value, k_cache, v_cache, slots):  # swaps K and V
        K.reshape_and_cache(value, key, k_cache, v_cache, slots)

    result = check_scatter_kernel(wrong)
    assert not result.ok and "does not hold its key" in result.message


def test_kernel_block_row_checker() -> None:
    assert check_kernel_block_row([14, 15, 4, 5], [7, 2], 32, 16).ok
    wrong = check_kernel_block_row([7, 8, 2, 3], [7, 2], 32, 16)
    assert not wrong.ok and "entry 0 is 7, expected 14" in wrong.message
    assert not check_kernel_block_row([1], [1], 48, 32).ok
