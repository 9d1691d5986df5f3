"""The MLA backend trio on hand-built batches: the split, the cache write, forward_mqa and
forward_mha against a float64 reference that never absorbs a weight, and against each other.

The reference computes what DeepSeek's modelling code computes: per head, K = [W_UK c | k_pe],
V = W_UV c, causal softmax over the request's whole sequence. It reads the latents from the
test's own lists, not from the paged cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.mla.common import (
    MLACommonMetadataBuilder,
    MLADims,
    MLAPrefillMetadata,
    concat_and_cache_mla,
    split_decodes_and_prefills,
)
from pagedkv.attention.mla.torch_ref_mla import TorchRefMLAImpl, TorchRefMLAMetadataBuilder
from pagedkv.kv_cache.spec import MLAAttentionSpec
from tests.conftest import needs_triton_on_cpu

# qk_head_dim 24: a head size the paged attention kernel takes, so TRITON_MLA's batched prefill runs.
DIMS = MLADims(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=10)
HEADS, BLOCK_SIZE, NUM_BLOCKS = 4, 4, 40
needs_interpreter = needs_triton_on_cpu("TRITON_MLA")


@dataclass
class Batch:
    """A decodes-first batch over a paged latent cache, with the tensors the model would pass."""

    common: CommonAttentionMetadata
    q: torch.Tensor  # [tokens, heads, qk_head_dim]
    kv_c: torch.Tensor  # [tokens, kv_lora_rank]: this step's new latents
    k_pe: torch.Tensor  # [tokens, rope]
    kv_cache: torch.Tensor
    latents: list[tuple[torch.Tensor, torch.Tensor]]  # per request: every position's (c_kv, k_pe)
    query_lens: list[int]
    dims: MLADims = DIMS
    heads: int = HEADS


def make_batch(
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    dims: MLADims = DIMS,
    heads: int = HEADS,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
) -> Batch:
    """Requests with `context_lens` tokens already cached and `query_lens` new ones; the cached
    rows are written with `concat_and_cache_mla`, the new ones left for the step to write."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(num_blocks, block_size, dims.latent_size, dtype=dtype)
    free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # block 0 is the null block
    max_blocks = max(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens))
    block_table = torch.zeros(len(query_lens), max_blocks, dtype=torch.int32)
    latents, slots = [], []
    for i, (c, q) in enumerate(zip(context_lens, query_lens)):
        n = -(-(c + q) // block_size)
        block_table[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        kv_c = torch.randn(c + q, dims.kv_lora_rank, generator=g).to(dtype)
        k_pe = torch.randn(c + q, dims.qk_rope_head_dim, generator=g).to(dtype)
        latents.append((kv_c, k_pe))
        pos = torch.arange(c + q)
        all_slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        concat_and_cache_mla(kv_c[:c], k_pe[:c], kv_cache, all_slots[:c])
        slots.append(all_slots[c:])
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.cat(slots),
    )
    new = [(kv_c[c:], k_pe[c:]) for (kv_c, k_pe), c in zip(latents, context_lens)]
    q = torch.randn(sum(query_lens), heads, dims.qk_head_dim, generator=g).to(dtype)
    return Batch(
        common,
        q,
        torch.cat([n[0] for n in new]),
        torch.cat([n[1] for n in new]),
        kv_cache,
        latents,
        query_lens,
        dims,
        heads,
    )


def kv_b_weight(
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
    dims: MLADims = DIMS,
    heads: int = HEADS,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    return (torch.randn(rows, dims.kv_lora_rank, generator=g) / dims.kv_lora_rank**0.5).to(dtype)


SCALE = DIMS.qk_head_dim**-0.5


def reference(batch: Batch, weight: torch.Tensor) -> torch.Tensor:
    """float64 [tokens, heads, v_head_dim], K and V materialised per head (no absorption)."""
    dims, heads = batch.dims, batch.heads
    w = weight.double().view(heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    w_uk, w_uv = w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim :]
    outs, start = [], 0
    for (kv_c, k_pe), q_len in zip(batch.latents, batch.query_lens):
        seq_len = kv_c.shape[0]
        k = torch.cat(
            [torch.einsum("hnl,sl->shn", w_uk, kv_c.double()), k_pe.double()[:, None, :].expand(-1, heads, -1)], dim=-1
        )
        v = torch.einsum("hvl,sl->shv", w_uv, kv_c.double())
        q = batch.q[start : start + q_len].double()
        scores = torch.einsum("qhd,shd->hqs", q, k) * dims.qk_head_dim**-0.5
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqs,shv->qhv", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def make_impl(weight: torch.Tensor) -> TorchRefMLAImpl:
    impl = TorchRefMLAImpl(HEADS, DIMS.latent_size, SCALE, 1, None, weight.dtype, mla_dims=DIMS)
    impl.process_weights_after_loading(weight)
    return impl


def run(
    impl: TorchRefMLAImpl,
    batch: Batch,
    builder: MLACommonMetadataBuilder | None = None,
    padding: int = 0,
) -> torch.Tensor:
    """One step as the layer runs it: write the new rows, then attend. The output buffer starts as
    NaN and has `padding` rows past the step's tokens (as under a CUDA graph)."""
    spec = MLAAttentionSpec(BLOCK_SIZE, 1, DIMS.latent_size, batch.kv_cache.dtype)
    builder = builder or TorchRefMLAMetadataBuilder(spec, ["layer"], None, torch.device("cpu"))  # type: ignore[arg-type]
    metadata = builder.build(batch.common)
    impl.do_kv_cache_update(None, batch.kv_c, batch.k_pe, batch.kv_cache, batch.common.slot_mapping)  # type: ignore[arg-type]
    output = torch.full((batch.q.shape[0] + padding, HEADS, DIMS.v_head_dim), float("nan"), dtype=batch.q.dtype)
    return impl.forward(None, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, metadata, output)  # type: ignore[arg-type]


def test_split_decodes_and_prefills_by_hand() -> None:
    batch = make_batch([5, 2, 0, 3, 4], [1, 1, 5, 1, 3])
    # d d | p(5) d(1, after a prefill: treated as a prefill) p(3)
    assert split_decodes_and_prefills(batch.common) == (2, 3, 2, 9)
    assert split_decodes_and_prefills(make_batch([3, 4], [1, 1]).common) == (2, 0, 2, 0)
    assert split_decodes_and_prefills(make_batch([0], [7]).common) == (0, 1, 0, 7)


def test_concat_and_cache_mla_writes_rows_and_sends_padding_to_the_null_block() -> None:
    cache = torch.zeros(3, 2, DIMS.latent_size)
    kv_c, k_pe = torch.randn(3, DIMS.kv_lora_rank), torch.randn(3, DIMS.qk_rope_head_dim)
    concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([5, -1, 2]))
    assert torch.equal(cache[2, 1], torch.cat([kv_c[0], k_pe[0]]))  # slot 5 = block 2, offset 1
    assert torch.equal(cache[1, 0], torch.cat([kv_c[2], k_pe[2]]))
    assert torch.equal(cache[0, 0], torch.cat([kv_c[1], k_pe[1]]))  # padding: the null block's slot 0
    assert cache[1, 1].abs().sum() == 0 and cache[2, 0].abs().sum() == 0


@pytest.mark.parametrize("chunk", [4096, 3])
def test_mixed_batch_matches_the_unabsorbed_reference(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Decodes (absorbed, forward_mqa) and prefills, whole and chunked continuations (forward_mha,
    context up-projected in chunks of `chunk` tokens), in one step."""
    monkeypatch.setattr(MLACommonMetadataBuilder, "context_chunk_tokens", chunk)
    batch = make_batch([5, 1, 12, 0, 7], [1, 1, 1, 6, 3])
    weight = kv_b_weight()
    out = run(make_impl(weight), batch)
    torch.testing.assert_close(out.double(), reference(batch, weight), atol=2e-5, rtol=0)


def test_bfloat16_batch_is_close_to_the_reference() -> None:
    batch = make_batch([6, 0, 9], [1, 5, 2], dtype=torch.bfloat16)
    weight = kv_b_weight(torch.bfloat16)
    out = run(make_impl(weight), batch)
    torch.testing.assert_close(out.double(), reference(batch, weight), atol=3e-2, rtol=0)


def test_forward_mqa_and_forward_mha_agree_on_the_same_tokens() -> None:
    """The decodes of a step, attended once with W_UK absorbed (forward_mqa) and once as
    one-token prefills with K and V up-projected (forward_mha)."""
    batch = make_batch([5, 1, 13], [1, 1, 1])
    impl = make_impl(kv_b_weight())
    absorbed = run(impl, batch)
    as_prefills = torch.empty_like(absorbed)
    prefill = MLAPrefillMetadata(
        query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=batch.common.seq_lens_cpu.tolist(),
        block_table=batch.common.block_table_tensor,
        context_chunk_tokens=4,
    )
    impl.forward_mha(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, prefill, as_prefills)
    torch.testing.assert_close(absorbed, as_prefills, atol=1e-5, rtol=0)


def test_padding_rows_after_the_steps_tokens_are_zero() -> None:
    """Under a CUDA graph the output has rows past num_actual_tokens (padding): they must be
    zeros, not whatever the buffer held, since the next layer reads them."""
    batch = make_batch([5, 3], [1, 4])
    num_tokens = batch.q.shape[0]
    out = run(make_impl(kv_b_weight()), batch, padding=3)
    assert torch.equal(out[num_tokens:], torch.zeros(3, HEADS, DIMS.v_head_dim))
    torch.testing.assert_close(out[:num_tokens].double(), reference(batch, kv_b_weight()), atol=1e-4, rtol=0)


def test_a_cache_never_written_fails_the_comparison() -> None:
    """The comparison can fail: decodes reading a cache whose rows were never written."""
    batch = make_batch([5, 9], [1, 1])
    weight = kv_b_weight()
    batch.kv_cache.zero_()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run(make_impl(weight), batch).double(), reference(batch, weight), atol=1e-3, rtol=0)


def test_unsplit_weights_are_a_clear_error() -> None:
    impl = TorchRefMLAImpl(HEADS, DIMS.latent_size, SCALE, 1, None, torch.float32, mla_dims=DIMS)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        run(impl, make_batch([2], [1]))


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_mla_matches_torch_ref_mla_and_the_reference(splits: int) -> None:
    pytest.importorskip("triton")
    from pagedkv.attention.mla.triton_mla import TritonMLADecodeMetadata, TritonMLAImpl
    from pagedkv.kernels import MLADecodeWorkspace

    batch = make_batch([5, 1, 13, 30], [1, 1, 1, 1])
    weight = kv_b_weight()
    spec = MLAAttentionSpec(BLOCK_SIZE, 1, DIMS.latent_size, torch.float32)
    metadata = TorchRefMLAMetadataBuilder(spec, ["layer"], None, torch.device("cpu")).build(batch.common)  # type: ignore[arg-type]
    metadata.decode = TritonMLADecodeMetadata(
        **metadata.decode.__dict__,
        num_kv_splits=splits,
        workspace=MLADecodeWorkspace(4, HEADS, DIMS.kv_lora_rank, "cpu"),
    )
    triton_impl = TritonMLAImpl(HEADS, DIMS.latent_size, SCALE, 1, None, torch.float32, mla_dims=DIMS)
    triton_impl.process_weights_after_loading(weight)
    triton_impl.do_kv_cache_update(None, batch.kv_c, batch.k_pe, batch.kv_cache, batch.common.slot_mapping)  # type: ignore[arg-type]
    out = torch.empty(4, HEADS, DIMS.v_head_dim)
    triton_impl.forward(None, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, metadata, out)  # type: ignore[arg-type]
    torch.testing.assert_close(out.double(), reference(batch, weight), atol=1e-4, rtol=0)
    ref_impl = make_impl(weight)
    ref_out = torch.empty_like(out)
    ref_impl.forward(None, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, metadata, ref_out)  # type: ignore[arg-type]
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)  # TRITON_MLA against TORCH_REF_MLA


# The paged kernel takes V heads of a multiple of 8 from 16 up; DIMS' 10 sends prefills to the shared loop.
PAGED_DIMS = MLADims(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@needs_interpreter
@pytest.mark.parametrize("tokens_per_pass, scale_factor", [(32768, 1.0), (12, 1.59)])
def test_triton_mla_prefill_passes_match_the_reference(tokens_per_pass: int, scale_factor: float) -> None:
    """TRITON_MLA's forward_mha: prefills (a whole prompt, and continuations of 7 and 25 cached
    tokens) gathered, up-projected and attended by the paged kernel. Budget 32768: one pass;
    budget 12: passes of 6 and 10 tokens, and the 30-token request alone on the chunked path.
    The second case's softmax scale is not 1/sqrt(qk_head_dim): YaRN's mscale multiplies it (1.59
    for DeepSeek-V2-Lite), and every pass must use the impl's scale."""
    pytest.importorskip("triton")
    from pagedkv.attention.mla.triton_mla import TritonMLAImpl, TritonMLAPrefillMetadata, group_prefill_passes

    batch = make_batch([5, 1, 12, 0, 7, 25], [1, 1, 1, 6, 3, 5], dims=PAGED_DIMS)
    weight = kv_b_weight(dims=PAGED_DIMS)
    spec = MLAAttentionSpec(BLOCK_SIZE, 1, PAGED_DIMS.latent_size, torch.float32)
    metadata = TorchRefMLAMetadataBuilder(spec, ["layer"], None, torch.device("cpu")).build(batch.common)  # type: ignore[arg-type]
    metadata.prefill = group_prefill_passes(metadata.prefill, BLOCK_SIZE, tokens_per_pass, torch.device("cpu"))
    assert isinstance(metadata.prefill, TritonMLAPrefillMetadata)
    expected_passes = {32768: ([slice(0, 14)], []), 12: ([slice(0, 6), slice(6, 9)], [slice(9, 14)])}[tokens_per_pass]
    assert [p.tokens for p in metadata.prefill.passes] == expected_passes[0]
    assert [rows for rows, _ in metadata.prefill.long_requests] == expected_passes[1]
    scale = PAGED_DIMS.qk_head_dim**-0.5 * scale_factor
    impl = TritonMLAImpl(HEADS, PAGED_DIMS.latent_size, scale, 1, None, torch.float32, mla_dims=PAGED_DIMS)
    assert impl.kernel_takes_heads  # the passes run the paged kernel, not the shared loop
    impl.process_weights_after_loading(weight)
    impl.do_kv_cache_update(None, batch.kv_c, batch.k_pe, batch.kv_cache, batch.common.slot_mapping)  # type: ignore[arg-type]
    nd = metadata.num_decode_tokens
    out = torch.full((batch.q.shape[0] - nd, HEADS, PAGED_DIMS.v_head_dim), float("nan"))
    impl.forward_mha(batch.q[nd:], batch.kv_c[nd:], batch.k_pe[nd:], batch.kv_cache, metadata.prefill, out)
    # The reference scales by 1/sqrt(qk_head_dim): scaling q by the factor gives the impl's scale.
    expected = reference(dataclasses.replace(batch, q=batch.q * scale_factor), weight)[nd:]
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=0)


@needs_interpreter
def test_prefill_passes_at_the_v2_lite_shape_in_bfloat16() -> None:
    pytest.importorskip("triton")
    check_prefill_passes("cpu", context_lens=[0, 20, 5], query_lens=[9, 3, 4])


def check_prefill_passes(device: str, context_lens: list[int], query_lens: list[int]) -> None:
    """TRITON_MLA's prefill passes and the shared loop over requests, at DeepSeek-V2-Lite's
    attention shape in bf16 (16 heads, latent 512 + 64, qk 192, v 128, pages of 16): both within
    bf16's reach of float64 (relative error of the whole output), and of each other. The GPU test
    (tests/gpu/test_mla_cuda.py) runs it with long contexts."""
    from pagedkv.attention.mla.triton_mla import TritonMLAImpl, TritonMLAMetadataBuilder, group_prefill_passes

    dims, heads, block_size = MLADims(512, 128, 64, 128), 16, 16
    pages = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens))
    batch = make_batch(
        context_lens, query_lens, torch.bfloat16, dims=dims, heads=heads, block_size=block_size, num_blocks=pages + 1
    )
    weight = kv_b_weight(torch.bfloat16, dims=dims, heads=heads)
    expected = reference(batch, weight)  # float64 from the same bf16 inputs

    cm = batch.common
    cm = dataclasses.replace(
        cm,
        query_start_loc=cm.query_start_loc.to(device),
        seq_lens=cm.seq_lens.to(device),
        block_table_tensor=cm.block_table_tensor.to(device),
        slot_mapping=cm.slot_mapping.to(device),
    )
    spec = MLAAttentionSpec(block_size, 1, dims.latent_size, torch.bfloat16)
    prefill = TorchRefMLAMetadataBuilder(spec, ["layer"], None, torch.device(device)).build(cm).prefill  # type: ignore[arg-type]
    passes = group_prefill_passes(
        prefill, block_size, TritonMLAMetadataBuilder.prefill_tokens_per_pass, torch.device(device)
    )
    impl = TritonMLAImpl(heads, dims.latent_size, dims.qk_head_dim**-0.5, 1, None, torch.bfloat16, mla_dims=dims)
    impl.process_weights_after_loading(weight.to(device))
    kv_cache, kv_c, k_pe, q = (t.to(device) for t in (batch.kv_cache, batch.kv_c, batch.k_pe, batch.q))
    impl.do_kv_cache_update(None, kv_c, k_pe, kv_cache, cm.slot_mapping)  # type: ignore[arg-type]
    outs = []
    for metadata in (passes, prefill):  # plain MLAPrefillMetadata: the shared loop over requests
        out = torch.empty(q.shape[0], heads, dims.v_head_dim, dtype=torch.bfloat16, device=device)
        impl.forward_mha(q, kv_c, k_pe, kv_cache, metadata, out)
        outs.append(out.double().cpu())
    relative = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert relative(outs[0], expected) < 1e-2 and relative(outs[1], expected) < 1e-2, (
        relative(outs[0], expected),
        relative(outs[1], expected),
    )
    assert relative(outs[0], outs[1]) < 1e-2
