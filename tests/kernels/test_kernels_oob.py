"""The Triton kernels must read and write only inside their tensors (issue 8), under the interpreter.

Head sizes that are not a power of two (72, 80, 96, 112) are computed in tiles padded to the next
power of two, so every K/V/q/out access has lanes past the head. Here each tensor is a
`poisoned` copy: NaN between heads and tokens, the cache at the very end of its buffer, unused
cache blocks and page-table entries pointing at NaN. A kernel that touches a padded lane, a key
past the sequence or an unwritten split gets NaN deterministically (0 * NaN = NaN in the scores),
instead of the "one run in three" of whatever memory happens to follow the tensor. Writes
outside the output or the written cache slots show up as non-NaN values in the surroundings.

Run with TRITON_INTERPRET=1 set in the environment (as CI does).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.kernels import KernelConfig, reshape_and_cache  # noqa: E402
from pagedkv.kernels.testing import (  # noqa: E402
    PagedBatch,
    outside,
    overread_gap,
    poisoned,
    random_paged_batch,
    run_poisoned,
)
from tests.conftest import needs_triton_on_cpu  # noqa: E402
from tests.kernels.test_kernels import assert_close, dense_reference  # noqa: E402  (float64, slot by slot)

pytestmark = needs_triton_on_cpu("CPU kernel tests")
SEEDS = [0, 1, 2]


def check_poisoned_attention(
    batch: PagedBatch, sliding_window: int | None = None, config: KernelConfig | None = None
) -> None:
    """Run on the poisoned batch into a poisoned, NaN-filled output; compare with float64 on the clean one."""
    out, stray = run_poisoned(batch, sliding_window, config)
    nans = int(out.isnan().sum())
    assert nans == 0, f"NaN in {nans} of {out.numel()} outputs: the kernel read outside its inputs"
    assert_close(out, dense_reference(batch, batch.q.shape[2] ** -0.5, sliding_window), batch.q.dtype)
    assert stray == 0, f"{stray} values written outside the output and the split-KV workspace"


@pytest.mark.parametrize("seed", SEEDS)
def test_issue_reproducer_gqa3_head_80(seed: int) -> None:
    # The batch of the issue: 6 query / 2 KV heads, blocks of 32, seq_lens [37, 5, 64, 1].
    batch = random_paged_batch(
        [37, 1, 10, 1], [0, 4, 54, 0], num_q_heads=6, num_kv_heads=2, head_size=80, block_size=32, seed=seed
    )
    assert batch.seq_lens.tolist() == [37, 5, 64, 1]
    check_poisoned_attention(batch)


# (head_size, num_q_heads, num_kv_heads, block_size, query_lens, context_lens)
LAYOUTS = {
    "d72-mqa-mixed": (72, 4, 1, 16, [1, 12, 1, 20], [40, 0, 9, 17]),
    "d96-mha-chunked": (96, 2, 2, 32, [18, 1], [31, 70]),
    "d112-gqa3-prefill": (112, 6, 2, 16, [23, 9], [0, 0]),
    "d80-gqa-block8": (80, 4, 2, 8, [1, 7, 1], [33, 12, 0]),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_head_sizes_block_sizes_and_gqa(layout: str, seed: int) -> None:
    head_size, num_q_heads, num_kv_heads, block_size, query_lens, context_lens = LAYOUTS[layout]
    batch = random_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        seed=seed,
    )
    check_poisoned_attention(batch)


@pytest.mark.parametrize("head_size", [72, 112])
def test_sliding_window(head_size: int) -> None:
    # The window's lower edge is a masked tile of its own kind.
    batch = random_paged_batch([1, 14, 1], [45, 20, 8], head_size=head_size, seed=head_size)
    check_poisoned_attention(batch, sliding_window=11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision(dtype: torch.dtype) -> None:
    batch = random_paged_batch([1, 9, 1], [30, 6, 0], head_size=80, dtype=dtype, seed=4)
    check_poisoned_attention(batch)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("head_size", [80, 96, 72, 112])
def test_split_kv_decode(head_size: int, seed: int) -> None:
    # The partials live in a NaN workspace of exactly num_tokens * num_splits rows. 3 splits (a
    # padded lane in the merge's tile of 4) of a 10-key sequence leave two of them empty.
    batch = random_paged_batch([1, 1, 1], [9, 50, 29], num_q_heads=6, num_kv_heads=2, head_size=head_size, seed=seed)
    config = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=3)
    check_poisoned_attention(batch, config=config)


@pytest.mark.parametrize("head_size", [72, 80, 96, 112])
def test_reshape_and_cache_writes_only_its_slots(head_size: int) -> None:
    gen = torch.Generator().manual_seed(head_size)
    num_kv_heads, block_size, num_blocks, num_tokens = 3, 16, 4, 9
    gap = overread_gap(head_size)
    # NaN after the cache's last row too: a stray store is then reported, not a corrupted heap.
    kv_cache = poisoned(torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen), gap, tail=gap)
    before = kv_cache.clone()
    # Finite values around key/value: a store of a padded lane would put them into the NaN.
    key, value = (
        poisoned(torch.randn(num_tokens + 2, num_kv_heads, head_size, generator=gen), gap, fill=7.0) for _ in range(2)
    )
    last = num_blocks * block_size - 1  # the last slot of the last block: the end of the cache
    slots = torch.cat([torch.randperm(last, generator=gen)[: num_tokens - 1], torch.tensor([last])])
    slots[3] = -1  # a padding token
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)

    expected = before.reshape(2, -1, num_kv_heads, head_size)
    written = slots >= 0
    expected[0, slots[written]] = key[:num_tokens][written]
    expected[1, slots[written]] = value[:num_tokens][written]
    assert torch.equal(kv_cache.reshape(2, -1, num_kv_heads, head_size), expected)
    assert outside(kv_cache).isnan().all(), "reshape_and_cache wrote outside the cache"
