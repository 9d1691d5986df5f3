"""TORCH_REF against a float64 dense computation on random ragged batches and page tables."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.backends.torch_ref import TorchRefImpl, TorchRefMetadataBuilder, paged_attention_reference
from pagedkv.kv_cache.spec import FullAttentionSpec


def dense_attention_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of k/v [S, Hkv, D]; a plain masked softmax in float64."""
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_heads, _ = q.shape
    n_k, n_kv, _ = k.shape
    out = torch.empty(n_q, n_heads, q.shape[-1], dtype=torch.float64)
    for h in range(n_heads):
        kh, vh = k[:, h // (n_heads // n_kv)], v[:, h // (n_heads // n_kv)]
        for i in range(n_q):
            pos = n_k - n_q + i
            scores = (kh[: pos + 1] @ q[i, h]) * scale
            if window is not None:
                scores[: max(pos - window + 1, 0)] = -math.inf
            out[i, h] = torch.softmax(scores, dim=0) @ vh[: pos + 1]
    return out


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    gen: torch.Generator,
):
    """Random K/V history per request, scattered into a cache through a random page table."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays null
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32)
    ks, vs, slots = [], [], []
    for i, s in enumerate(seq_lens):
        row = [perm.pop() for _ in range(blocks_per_req[i])]
        table[i, : len(row)] = torch.tensor(row)
        k = torch.randn(s, num_kv_heads, head_size, generator=gen)
        v = torch.randn(s, num_kv_heads, head_size, generator=gen)
        ks.append(k)
        vs.append(v)
        for p in range(s):
            slot = row[p // block_size] * block_size + p % block_size
            if p < context_lens[i]:  # history already in the cache
                cache[0].view(-1, num_kv_heads, head_size)[slot] = k[p]
                cache[1].view(-1, num_kv_heads, head_size)[slot] = v[p]
            else:  # this step's tokens: the impl writes them
                slots.append(slot)
    return seq_lens, table, cache, ks, vs, torch.tensor(slots)


CASES = [
    # (query_lens, context_lens): prefill, decode, mixed (decodes first), chunked prefill
    ([7, 3, 12], [0, 0, 0]),
    ([1, 1, 1, 1], [5, 17, 32, 1]),
    ([1, 1, 9, 4], [20, 3, 0, 11]),
]


@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_float64(query_lens, context_lens, heads, block_size, window) -> None:
    num_heads, num_kv_heads = heads
    head_size, scale = 8, 8**-0.5
    # crc32 of the case's text, not hash(): hash(None) changes from run to run before Python 3.12.
    case = repr((query_lens, context_lens, heads, block_size, window))
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    seq_lens, table, cache, ks, vs, slots = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size, gen
    )
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    q = torch.randn(n, num_heads, head_size, generator=gen)
    new_k = torch.cat([k[c:] for k, c in zip(ks, context_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(vs, context_lens)])
    # Two padding tokens at the end: slot -1, must be skipped by the write and zero in the output.
    pad = 2
    q = torch.cat([q, torch.randn(pad, num_heads, head_size, generator=gen)])
    new_k = torch.cat([new_k, torch.randn(pad, num_kv_heads, head_size, generator=gen)])
    new_v = torch.cat([new_v, torch.randn(pad, num_kv_heads, head_size, generator=gen)])
    slots = torch.cat([slots, torch.full((pad,), -1)])

    spec = FullAttentionSpec(block_size, num_kv_heads, head_size, torch.float32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=n,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=slots,
    )
    metadata = TorchRefMetadataBuilder(spec, ["l"], None, torch.device("cpu")).build(common)  # type: ignore[arg-type]
    impl = TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, torch.float32)
    untouched = cache[:, 0].clone()
    impl.do_kv_cache_update(None, new_k, new_v, cache, slots)  # type: ignore[arg-type]
    assert torch.equal(cache[:, 0], untouched), "a padding token was written somewhere"
    out = torch.full_like(q, float("nan"))
    impl.forward(None, q, new_k, new_v, cache, metadata, out)  # type: ignore[arg-type]

    for i in range(len(query_lens)):
        expected = dense_attention_f64(q[qsl[i] : qsl[i + 1]], ks[i], vs[i], scale, window)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_reference_float64_is_exact() -> None:
    """In float64 the reference computes in float64 too: no silent down-cast."""
    gen = torch.Generator().manual_seed(1)
    seq_lens, table, cache, ks, vs, slots = make_batch([3], [4], 2, 1, 4, 2, gen)
    cache = cache.double()
    impl = TorchRefImpl(2, 4, 0.5, 1, None, torch.float64)
    impl.do_kv_cache_update(None, ks[0][4:].double(), vs[0][4:].double(), cache, slots)  # type: ignore[arg-type]
    q = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    common = CommonAttentionMetadata(qsl, qsl, torch.tensor([7]), torch.tensor([7]), 1, 3, 3, 7, table, slots)
    metadata = TorchRefMetadataBuilder(None, [], None, torch.device("cpu")).build(common)  # type: ignore[arg-type]
    out = impl.forward(None, q, q, q, cache, metadata, torch.empty_like(q))  # type: ignore[arg-type]
    torch.testing.assert_close(out, dense_attention_f64(q, ks[0], vs[0], 0.5, None), atol=1e-12, rtol=1e-12)


def test_cache_write_fills_slot_0_and_skips_only_minus_one() -> None:
    """-1 is padding; 0 is a slot like any other (the engine keeps block 0 as the null block, so an
    engine run never writes it: only this test sees the difference)."""
    gen = torch.Generator().manual_seed(2)
    impl = TorchRefImpl(4, 16, 0.25, 2, None, torch.float32)
    kv_cache = torch.zeros(2, 5, 8, 2, 16)
    key, value = torch.randn(2, 4, 2, 16, generator=gen)
    slots = torch.tensor([0, 17, -1, 39])
    impl.do_kv_cache_update(None, key, value, kv_cache, slots)  # type: ignore[arg-type]
    flat, written = kv_cache.reshape(2, -1, 2, 16), slots >= 0
    assert torch.equal(flat[0, slots[written]], key[written]) and torch.equal(flat[1, slots[written]], value[written])
    assert int((flat.abs().sum((2, 3)) > 0).sum()) == 2 * 3  # nothing else written


def test_bfloat16_reference_computes_in_float32() -> None:
    """The oracle in bf16 rounds only its output (~0.007 here); softmax and sums in bf16 would be
    about four times worse (0.03), and every bf16 comparison against it would inherit that."""
    gen = torch.Generator().manual_seed(0)
    seq_len, query_len, heads, kv_heads, head_size, block_size = 200, 5, 4, 2, 64, 16
    q = (4 * torch.randn(query_len, heads, head_size, generator=gen)).bfloat16()  # peaked scores
    k, v = torch.randn(2, seq_len, kv_heads, head_size, generator=gen).bfloat16()
    num_blocks = -(-seq_len // block_size)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_size, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, kv_heads, head_size)[:seq_len], v_cache.view(-1, kv_heads, head_size)[:seq_len] = k, v
    out = torch.empty(query_len, heads, head_size, dtype=torch.bfloat16)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    paged_attention_reference(q, k_cache, v_cache, out, [0, query_len], [seq_len], table, head_size**-0.5)
    error = (out.double() - dense_attention_f64(q, k, v, head_size**-0.5, None)).abs().max().item()
    assert error < 0.015, error
