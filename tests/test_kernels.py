"""The Triton kernels on the CPU, through Triton's interpreter, against float64 dense attention.

Every case builds a random ragged batch over a KV cache whose blocks are handed out in a random
order (a permuted page table), so a kernel that ignored the block table, mixed up requests or
read past a sequence would fail. Shapes are tiny: the interpreter runs programs one at a time.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.kernels import KernelConfig, SplitKVWorkspace, reshape_and_cache, unified_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
DEVICE = "cpu"


@dataclass
class PagedBatch:
    """A ragged batch: queries, a paged K/V cache and the metadata the kernel reads."""

    q: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[1]


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(seq_lens), max(max(blocks_per_req), 1) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q, kv_cache, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        block_table, list(query_lens),
    )


def dense_reference(batch: PagedBatch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Float64 attention per request and head; keys fetched slot by slot through the block table."""
    num_q_heads = batch.q.shape[1]
    _, _, block_size, num_kv_heads, head_size = batch.kv_cache.shape
    group = num_q_heads // num_kv_heads
    flat = batch.kv_cache.double().reshape(2, -1, num_kv_heads, head_size)  # [2, slots, heads, D]
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = batch.query_start_loc[r].item(), batch.query_start_loc[r + 1].item()
        if start == end:
            continue
        pos = torch.arange(seq_len)
        slots = batch.block_table[r, pos // block_size].long() * block_size + pos % block_size
        keys, values = flat[0, slots], flat[1, slots]
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - pos[None, :] < sliding_window
        for h in range(num_q_heads):
            scores = batch.q[start:end, h].double() @ keys[:, h // group].T * scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:end, h] = probs @ values[:, h // group]
    return out


def run_kernel(batch: PagedBatch, sliding_window: int | None = None, **kwargs: object) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # poisoned: every row must be written
    unified_attention(
        batch.q, batch.k_cache, batch.v_cache, out,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        max_query_len=max(batch.query_lens), max_seq_len=int(batch.seq_lens.max()),
        block_table=batch.block_table, softmax_scale=batch.q.shape[2] ** -0.5,
        sliding_window=sliding_window, **kwargs,
    )
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "unwritten (NaN) output rows"
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (query_lens, context_lens): prefill, decode, chunked prefill and mixed batches.
BATCHES = {
    "prefill": ([7, 33, 1, 18], [0, 0, 0, 0]),
    "decode": ([1, 1, 1, 1, 1], [0, 15, 16, 40, 77]),
    "chunked": ([20, 5], [31, 64]),
    "mixed": ([1, 12, 1, 30, 1], [50, 0, 9, 17, 33]),
}
# (num_q_heads, num_kv_heads): MHA, GQA (a power of two and not), MQA.
HEADS = {"mha": (2, 2), "gqa": (4, 2), "gqa3": (6, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_attention_batches_and_head_layouts(kind: str, heads: str) -> None:
    query_lens, context_lens = BATCHES[kind]
    num_q_heads, num_kv_heads = HEADS[heads]
    batch = make_batch(query_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert_close(run_kernel(batch), dense_reference(batch, 64**-0.5), torch.float32)


@pytest.mark.parametrize("head_size", [64, 96])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_attention_head_and_block_sizes(head_size: int, block_size: int, kind: str) -> None:
    batch = make_batch(*BATCHES[kind], head_size=head_size, block_size=block_size, seed=head_size + block_size)
    assert_close(run_kernel(batch), dense_reference(batch, head_size**-0.5), torch.float32)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("kind", ["mixed", "decode", "chunked"])
def test_attention_sliding_window(window: int, kind: str) -> None:
    batch = make_batch(*BATCHES[kind], seed=window)
    ref = dense_reference(batch, 64**-0.5, sliding_window=window)
    assert_close(run_kernel(batch, sliding_window=window), ref, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("window", [None, 20])
def test_split_kv_decode_matches_unsplit(num_splits: int, window: int | None) -> None:
    # Splits with no keys at all (7 splits of a 15-key sequence) must merge to the same result.
    batch = make_batch([1, 1, 1, 2], [14, 45, 90, 30], seed=num_splits)
    ref = dense_reference(batch, 64**-0.5, sliding_window=window)
    config = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    assert_close(run_kernel(batch, window, config=config), ref, torch.float32)


def test_split_kv_workspace_is_reused_and_bounds_the_splits() -> None:
    batch = make_batch([1, 1, 1], [100, 60, 7])
    workspace = SplitKVWorkspace(rows=6, num_q_heads=4, head_size=64, device=DEVICE)
    ref = dense_reference(batch, 64**-0.5)
    for _ in range(2):  # the same scratch serves consecutive calls
        assert_close(run_kernel(batch, workspace=workspace), ref, torch.float32)
    with pytest.raises(ValueError, match="workspace has 6 rows"):
        workspace.views(num_tokens=3, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_low_precision(dtype: torch.dtype) -> None:
    batch = make_batch(*BATCHES["mixed"], dtype=dtype, seed=3)
    assert_close(run_kernel(batch), dense_reference(batch, 64**-0.5), dtype)


def test_padding_tokens_and_empty_requests_are_left_alone() -> None:
    # CUDA-graph padding: a request with no tokens, and rows past query_start_loc[-1].
    batch = make_batch([3, 0, 1], [5, 0, 20])
    ref = dense_reference(batch, 64**-0.5)
    padded_q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:])])
    out = torch.full_like(padded_q, float("nan"))
    for max_query_len in (3, 16):  # an over-estimate only changes the launch shape
        unified_attention(
            padded_q, batch.k_cache, batch.v_cache, out, query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens, max_query_len=max_query_len, max_seq_len=64,
            block_table=batch.block_table, softmax_scale=64**-0.5,
        )
        assert_close(out[:4], ref, torch.float32)
        assert out[4:].isnan().all()


def test_matches_reference_backend() -> None:
    torch_ref = pytest.importorskip("pagedkv.attention.backends.torch_ref")
    batch = make_batch(*BATCHES["mixed"], num_q_heads=4, num_kv_heads=1, head_size=96, seed=11)
    expected = torch.empty_like(batch.q)
    torch_ref.paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, expected, batch.query_start_loc.tolist(),
        batch.seq_lens.tolist(), batch.block_table, 96**-0.5, sliding_window=9,
    )
    torch.testing.assert_close(run_kernel(batch, sliding_window=9), expected, atol=2e-5, rtol=2e-5)


def test_attention_rejects_unsupported_inputs() -> None:
    batch = make_batch([2], [0], head_size=64)
    kwargs = dict(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, max_query_len=2,
                  max_seq_len=2, block_table=batch.block_table, softmax_scale=1.0)
    q = torch.zeros(2, 4, 300)
    cache = torch.zeros(4, 16, 2, 300)
    with pytest.raises(ValueError, match="head size 300"):
        unified_attention(q, cache, cache, q.clone(), **kwargs)
    q64 = batch.q.double()
    with pytest.raises(ValueError, match="float64"):
        unified_attention(q64, batch.k_cache.double(), batch.v_cache.double(), q64.clone(), **kwargs)
    q3 = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match="3 query heads"):
        unified_attention(q3, batch.k_cache, batch.v_cache, q3.clone(), **kwargs)


# --- reshape_and_cache -----------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(2, 64, 16), (3, 96, 32), (1, 80, 16)])
def test_reshape_and_cache_scatters_by_slot(
    slot_dtype: torch.dtype, num_kv_heads: int, head_size: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_blocks, num_tokens = 6, 11
    # One (2, blocks, block_size, heads, D) tensor per layer; K and V are strided views of it.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    before = kv_cache.clone()
    # K and V as the model makes them: slices of one fused projection (non-contiguous rows).
    qkv = torch.randn(num_tokens + 2, 3, num_kv_heads, head_size, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots.to(slot_dtype))

    expected = before.reshape(2, -1, num_kv_heads, head_size).clone()
    written = slots >= 0
    expected[0, slots[written]] = key[:num_tokens][written]
    expected[1, slots[written]] = value[:num_tokens][written]
    assert torch.equal(kv_cache.reshape(2, -1, num_kv_heads, head_size), expected)


def test_reshape_and_cache_then_attention_low_precision() -> None:
    # A whole step: write this step's K/V, then attend over the cache that now holds them.
    batch = make_batch([4, 1], [0, 21], dtype=torch.bfloat16, seed=5)
    num_kv_heads, head_size = batch.kv_cache.shape[3:]
    block_size = batch.kv_cache.shape[2]
    new_k = torch.randn(5, num_kv_heads, head_size).to(torch.bfloat16)
    new_v = torch.randn(5, num_kv_heads, head_size).to(torch.bfloat16)
    slots = []
    for r, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens.tolist())):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(batch.block_table[r, pos // block_size]) * block_size + pos % block_size)
    reshape_and_cache(new_k, new_v, batch.k_cache, batch.v_cache, torch.tensor(slots))
    flat = batch.kv_cache.reshape(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[0, slots], new_k) and torch.equal(flat[1, slots], new_v)
    assert_close(run_kernel(batch), dense_reference(batch, head_size**-0.5), torch.bfloat16)


def test_reshape_and_cache_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="do not match"):
        reshape_and_cache(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), cache[0], cache[1], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="int32/int64"):
        reshape_and_cache(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0], cache[1], torch.zeros(3))
