"""Checkers for notebooks 06 (write the scatter kernel) and 07 (rewrite a block table)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.exercises import CheckResult, compare
from pagedkv.platforms import default_device
from pagedkv.worker.attn_utils import to_kernel_block_table

ScatterFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _scatter_case(seed: int, num_tokens: int, block_size: int, num_kv_heads: int, head_size: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: max(1, num_tokens // 4)]] = -1  # padding tokens
    # The engine's layout: one (2, blocks, block_size, heads, head_size) tensor, K and V as views.
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    device = default_device()  # compiled Triton needs GPU tensors; the interpreter takes CPU ones
    return key.to(device), value.to(device), kv_cache.to(device), slots.to(device)


def check_scatter_kernel(scatter: ScatterFn) -> CheckResult:
    """Run `scatter(key, value, k_cache, v_cache, slot_mapping)` on random cases and compare
    every cache position with a plain-torch scatter; name the first wrong token."""
    for seed, (num_tokens, block_size, heads, head_size) in enumerate([(6, 4, 2, 8), (13, 16, 1, 16)]):
        key, value, kv_cache, slots = _scatter_case(seed, num_tokens, block_size, heads, head_size)
        expected = kv_cache.clone()
        valid = slots >= 0
        expected[0].view(-1, heads, head_size)[slots[valid]] = key[valid]
        expected[1].view(-1, heads, head_size)[slots[valid]] = value[valid]
        scatter(key, value, kv_cache[0], kv_cache[1], slots)
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, block_size)
            for name, i, src in (("key", 0, key), ("value", 1, value)):
                if not torch.allclose(kv_cache[i, block, offset], src[t]):
                    return CheckResult(False, (
                        f"token {t} has slot {slot} = block {block} * {block_size} + offset {offset}, but "
                        f"cache[{i}][{block}][{offset}] does not hold its {name}. "
                        "Hint: block = slot // block_size, offset = slot % block_size, then use the cache strides."
                    ))
        if not torch.equal(kv_cache, expected):
            return CheckResult(False, (
                "every token landed in its slot, but something else in the cache changed too: "
                "a padding token (slot -1) must write nothing, and masked lanes must not be stored."
            ))
    return CheckResult(True, "scatter kernel: every token in its slot, padding skipped.")


def check_kernel_block_row(answer: list[int], row: list[int], block_size: int, kernel_block_size: int) -> CheckResult:
    """The row `row` of manager blocks of `block_size`, rewritten into kernel blocks."""
    if block_size % kernel_block_size:
        return CheckResult(False, f"{block_size} is not a multiple of {kernel_block_size}: no rewrite exists.")
    k = block_size // kernel_block_size
    expected = to_kernel_block_table(torch.tensor([row]), k)[0].tolist()
    return compare(
        "kernel block table row", list(answer), expected,
        hint=f"each manager block b becomes the {k} kernel blocks b*{k} ... b*{k}+{k - 1}, in order.",
    )
