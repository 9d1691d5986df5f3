"""The Triton kernels on a CUDA GPU: realistic sizes, every dtype, CUDA graph capture, poisoned memory."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.attention.backends.torch_ref import paged_attention_reference  # noqa: E402
from pagedkv.kernels import SplitKVWorkspace, reshape_and_cache, unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import choose_config  # noqa: E402
from pagedkv.kernels.testing import (  # noqa: E402
    PagedBatch,
    outside,
    overread_gap,
    poisoned,
    random_paged_batch,
    run_poisoned,
)
from pagedkv.kernels.unified_attention import _tma_descriptors  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # ||out - ref|| / ||ref||


def reference(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """The reference backend's attention in float64."""
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    return paged_attention_reference(
        batch.q.double(),
        batch.k_cache.double(),
        batch.v_cache.double(),
        out,
        batch.query_start_loc.tolist(),
        batch.seq_lens.tolist(),
        batch.block_table,
        batch.q.shape[2] ** -0.5,
        sliding_window=sliding_window,
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "NaN/inf in the output (an unwritten row?)"
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e} above {TOLERANCE[dtype]:.0e}"


def run(batch: PagedBatch, **kwargs: object) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    return unified_attention(batch.q, batch.k_cache, batch.v_cache, out, **batch.attention_kwargs(), **kwargs)


def lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# name -> (query_lens, context_lens)
CASES = {
    "decode": ([1] * 24, lengths(24, 1, 3000, 0)),
    "decode-long": ([1] * 2, [9000, 17000]),
    "prefill": (lengths(4, 100, 1500, 1), [0] * 4),
    "mixed": ([1] * 12 + lengths(3, 50, 700, 2), lengths(15, 0, 2000, 3)),
    "spec-decode": ([4] * 8, lengths(8, 10, 1500, 4)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_llama_shapes(dtype: torch.dtype, case: str) -> None:
    batch = random_paged_batch(
        *CASES[case], num_q_heads=32, num_kv_heads=8, head_size=128, dtype=dtype, device="cuda", seed=7
    )
    assert_matches(run(batch), reference(batch), dtype)


@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_pages_of_128_take_the_tma_path(case: str) -> None:
    """Pages of 128 hold whole prefill key tiles: q, K and V go through tensor descriptors on Hopper.
    The slots past each sequence in its last page are NaN, as stale values may be."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA copies need Hopper (sm_90) or later")
    batch = random_paged_batch(
        *CASES[case], num_q_heads=32, num_kv_heads=8, head_size=128, block_size=128, dtype=torch.bfloat16,
        device="cuda", seed=3,
    )  # fmt: skip
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        if seq_len % 128:
            batch.kv_cache[:, batch.block_table[r, seq_len // 128], seq_len % 128 :] = float("nan")
    config = choose_config(
        device=batch.q.device, head_pad=128, dtype=torch.bfloat16, num_queries_per_kv=4, num_kv_heads=8,
        num_reqs=len(batch.query_lens), num_tokens=batch.q.shape[0], max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )  # fmt: skip
    assert config.tma and _tma_descriptors(batch.q, batch.k_cache, batch.v_cache, config) is not None
    assert_matches(run(batch), reference(batch), torch.bfloat16)


def _gqa_bf16_batch(case: str, head_size: int) -> PagedBatch:
    """The case's batch with 8 query heads over 2 KV heads of `head_size`, bf16, block size 32."""
    return random_paged_batch(
        *CASES[case],
        num_q_heads=8,
        num_kv_heads=2,
        head_size=head_size,
        block_size=32,
        dtype=torch.bfloat16,
        device="cuda",
        seed=head_size,
    )


@pytest.mark.parametrize("head_size", [64, 80, 96, 256])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_head_sizes(head_size: int, case: str) -> None:
    batch = _gqa_bf16_batch(case, head_size)
    assert_matches(run(batch), reference(batch), torch.bfloat16)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(16, 1), (12, 4), (8, 8)], ids=["mqa", "gqa3", "mha"])
@pytest.mark.parametrize("window", [None, 300])
def test_head_layouts_and_sliding_window(num_q_heads: int, num_kv_heads: int, window: int | None) -> None:
    batch = random_paged_batch(
        *CASES["mixed"],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=128,
        dtype=torch.float16,
        device="cuda",
        seed=num_q_heads,
    )
    assert_matches(run(batch, sliding_window=window), reference(batch, window), torch.float16)


# --- issue 8: nothing read or written outside the tensors, for heads padded to a power of two ---


@pytest.mark.parametrize("head_size", [72, 80, 96, 112, 200])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_poisoned_memory_head_sizes(case: str, head_size: int) -> None:
    # NaN between heads and tokens, the cache at the very end of its buffer, NaN in unowned blocks
    # and past each sequence (see `poison_batch`): a read outside the tensors turns into NaN.
    batch = _gqa_bf16_batch(case, head_size)
    out, stray = run_poisoned(batch)
    assert_matches(out, reference(batch), torch.bfloat16)
    assert stray == 0, f"{stray} values written outside the output and the split-KV workspace"


@pytest.mark.parametrize("seed,window", [(0, None), (1, None), (2, 20)])
def test_poisoned_memory_issue_reproducer(seed: int, window: int | None) -> None:
    # The batch of issue 8: 6 query / 2 KV heads, head size 80, blocks of 32, float32.
    batch = random_paged_batch(
        [37, 1, 10, 1],
        [0, 4, 54, 0],
        num_q_heads=6,
        num_kv_heads=2,
        head_size=80,
        block_size=32,
        device="cuda",
        seed=seed,
    )
    out, stray = run_poisoned(batch, sliding_window=window)
    assert_matches(out, reference(batch, window), torch.float32)
    assert stray == 0, f"{stray} values written outside the output and the split-KV workspace"


@pytest.mark.parametrize("head_size", [80, 200])
def test_poisoned_reshape_and_cache(head_size: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(head_size)
    num_blocks, block_size, num_tokens = 40, 16, 300
    gap = overread_gap(head_size)
    cache = torch.randn(2, num_blocks, block_size, 2, head_size, generator=gen, device="cuda")
    kv_cache = poisoned(cache, gap, tail=gap)  # NaN around it, and after it: a stray store shows
    before = kv_cache.clone()
    key, value = (torch.randn(num_tokens, 2, head_size, generator=gen, device="cuda") for _ in range(2))
    last = num_blocks * block_size - 1  # the cache's last slot
    slots = torch.randperm(last, generator=gen, device="cuda")[: num_tokens - 1]
    slots = torch.cat([slots, torch.tensor([last], device="cuda")])
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)
    expected = before.reshape(2, -1, 2, head_size)
    expected[0, slots], expected[1, slots] = key, value
    assert torch.equal(kv_cache.reshape(2, -1, 2, head_size), expected)
    assert outside(kv_cache).isnan().all(), "reshape_and_cache wrote outside the cache"


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reshape_and_cache(slot_dtype: torch.dtype) -> None:
    batch = random_paged_batch(
        *CASES["mixed"], num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda"
    )
    num_tokens = batch.q.shape[0]
    key = torch.randn(num_tokens + 4, 8, 128, device="cuda").bfloat16()
    value = torch.randn(num_tokens + 4, 8, 128, device="cuda").bfloat16()
    slots = batch.query_slots()
    slots[::7] = -1  # padding
    before = batch.kv_cache.clone()
    reshape_and_cache(key, value, batch.k_cache, batch.v_cache, slots.to(slot_dtype))
    expected = before.view(2, -1, 8, 128)
    written = slots >= 0
    expected[0, slots[written]] = key[:num_tokens][written]
    expected[1, slots[written]] = value[:num_tokens][written]
    assert torch.equal(batch.kv_cache.view(2, -1, 8, 128), expected)


def refill(target: PagedBatch, source: PagedBatch) -> None:
    """Copy a new batch's contents into the captured tensors (same shapes, new values)."""
    for name in ("q", "kv_cache", "query_start_loc", "seq_lens", "block_table"):
        getattr(target, name).copy_(getattr(source, name))


def has_flash_attn_4() -> bool:
    from pagedkv.attention.backends.flash_attn import flash_attn_version

    return flash_attn_version() == 4


@pytest.mark.parametrize("kernel", ["triton", "flash_attn_4"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_cuda_graph_replay_after_metadata_changes(kind: str, kernel: str) -> None:
    # Capture once, then replay on batches whose lengths, page tables and queries all changed.
    # A decode graph is captured with max_query_len=1; a mixed one with the token count as the
    # bound, since the launch shape must cover any batch replayed into it.
    if kernel == "flash_attn_4" and not has_flash_attn_4():
        pytest.skip("flash-attn 4 (flash_attn.cute) is not installed")
    if kind == "decode":
        shapes = [([1] * 6, lengths(6, 1, 6000, seed)) for seed in range(3)]
    else:
        shapes = [([1] * 4 + [60, 200], lengths(6, 0, 3000, seed)) for seed in range(3)]
        shapes[1] = ([1, 1, 1, 200, 60, 1], lengths(6, 0, 3000, 11))
    batches = [
        random_paged_batch(
            q, c, num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda", seed=i
        )
        for i, (q, c) in enumerate(shapes)
    ]
    # Same tensor shapes for every batch: pad caches and block tables to the largest.
    num_blocks = max(b.kv_cache.shape[1] for b in batches)
    width = max(b.block_table.shape[1] for b in batches)
    for b in batches:
        b.kv_cache = torch.cat(
            [b.kv_cache, torch.randn_like(b.kv_cache[:, :1]).expand(2, num_blocks - b.kv_cache.shape[1], -1, -1, -1)], 1
        )
        b.block_table = torch.nn.functional.pad(b.block_table, (0, width - b.block_table.shape[1]))
    live = batches[0]
    num_tokens = live.q.shape[0]
    max_query_len = 1 if kind == "decode" else num_tokens
    workspace = SplitKVWorkspace(rows=num_tokens * 64, num_q_heads=32, head_size=128, device="cuda")
    out = torch.empty_like(live.q)

    def step() -> None:
        if kernel == "triton":
            unified_attention(
                live.q,
                live.k_cache,
                live.v_cache,
                out,
                query_start_loc=live.query_start_loc,
                seq_lens=live.seq_lens,
                max_query_len=max_query_len,
                max_seq_len=8192,
                block_table=live.block_table,
                softmax_scale=128**-0.5,
                workspace=workspace,
            )
        else:
            from flash_attn.cute import flash_attn_varlen_func

            result = flash_attn_varlen_func(
                live.q,
                live.k_cache,
                live.v_cache,
                cu_seqlens_q=live.query_start_loc,
                seqused_k=live.seq_lens,
                max_seqlen_q=max_query_len,
                max_seqlen_k=8192,
                page_table=live.block_table,
                causal=True,
                softmax_scale=128**-0.5,
            )
            out.copy_(result[0])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for batch in batches[1:]:
        refill(live, batch)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(batch), torch.bfloat16)
