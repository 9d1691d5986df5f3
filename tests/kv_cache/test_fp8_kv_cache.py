"""The fp8 (e4m3) KV cache: bytes, quantization, attention over it, scales, refusals, the engine.

References are independent of the code under test: page sizes worked by hand, the e4m3 error
bound (half a step: 2^-4 relative, 2^-10 absolute below 2^-6), attention in float64 over the
dequantized cache, the fp32 cache's greedy tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends.flash_attn import FlashAttentionBackend
from pagedkv.attention.backends.torch_ref import TorchRefBackend, paged_attention_reference
from pagedkv.attention.backends.triton_attn import TritonAttentionBackend
from pagedkv.attention.mla.triton_mla import TritonMLABackend
from pagedkv.kernels import reshape_and_cache, unified_attention
from pagedkv.kernels.attention_config import KernelConfig
from pagedkv.kernels.testing import random_paged_batch
from pagedkv.kv_cache.fp8 import FP8_E4M3_MAX, quantize_fp8
from pagedkv.kv_cache.spec import FullAttentionSpec, get_kv_cache_config
from pagedkv.worker.draft_model import DRAFT_PREFIX
from tests.conftest import smoke_run

FP8 = torch.float8_e4m3fn


def test_page_size_bytes_halve_and_the_same_memory_holds_twice_the_blocks() -> None:
    bf16, fp8 = FullAttentionSpec(16, 2, 64, torch.bfloat16), FullAttentionSpec(16, 2, 64, FP8)
    assert bf16.page_size_bytes == 2 * 16 * 2 * 64 * 2 == 8192  # K and V, 16 tokens, 2 heads x 64, 2 bytes
    assert fp8.page_size_bytes == 2 * 16 * 2 * 64 * 1 == 4096
    specs = {f"model.layers.{i}.attn": bf16 for i in range(4)}
    fp8_specs = {name: fp8 for name in specs}
    memory = 4 * 8192 * 10  # ten bf16 blocks in four layers
    assert get_kv_cache_config(specs, memory_bytes=memory).num_blocks == 10
    assert get_kv_cache_config(fp8_specs, memory_bytes=memory).num_blocks == 20


def _e4m3_bound(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Half an e4m3 step at x / scale, in x's units: 2^-4 relative in the normal range, 2^-10 absolute below."""
    y = (x / scale).abs()
    return torch.where(y >= 2.0**-6, y * 2.0**-4, torch.full_like(y, 2.0**-10)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_within_the_e4m3_bound(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=gen, dtype=torch.float64) * torch.logspace(-5, 3, 4096, dtype=torch.float64)).to(
        dtype
    )
    scale = 0.37
    back = quantize_fp8(x, torch.tensor(scale)).double() * scale
    x64 = x.double()
    inside = (x64 / scale).abs() <= FP8_E4M3_MAX
    assert inside.sum() > 3500 and (~inside).sum() > 10  # both regimes exercised
    err = (back - x64).abs()
    assert (err[inside] <= _e4m3_bound(x64[inside], scale) * (1 + 1e-9)).all()
    # Past 448 it saturates (a plain cast would give NaN), keeping the sign.
    assert torch.equal(back[~inside], torch.sign(x64[~inside]) * FP8_E4M3_MAX * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_quantizes_as_torch_does(dtype: torch.dtype) -> None:
    """The Triton scatter stores the same bytes as torch's round-to-nearest-even cast of x / scale
    (saturated), values near every power of two included (where a carry moves the exponent)."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, head_size, blocks, block_size = 24, 2, 16, 8, 4
    mags = torch.logspace(-4, 3.3, tokens * heads * head_size).view(tokens, heads, head_size)
    key = (torch.randn(tokens, heads, head_size, generator=gen) * mags).to(dtype)
    value = (torch.randn(tokens, heads, head_size, generator=gen) * mags.flip(0)).to(dtype)
    k_cache = torch.zeros(blocks, block_size, heads, head_size, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # padding: not written
    k_scale, v_scale = torch.tensor(0.61), torch.tensor(0.013)
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    kept = slots >= 0
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        stored = cache.view(-1, heads, head_size)[slots[kept]]
        assert torch.equal(stored.view(torch.uint8), quantize_fp8(new[kept], scale).view(torch.uint8))
        assert (stored.float().abs() == FP8_E4M3_MAX).any()  # saturation exercised
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert (k_cache.view(-1, heads, head_size)[untouched].float() == 0).all()


def _fp8_batch(dtype: torch.dtype, seed: int) -> tuple[object, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged batch (decodes, a chunked prefill, GQA) whose cache is quantized to fp8 with two scales."""
    batch = random_paged_batch([1, 5, 1, 9], [20, 11, 3, 0], head_size=32, block_size=4, dtype=dtype, seed=seed)
    k, v = batch.kv_cache[0].float() * 3.0, batch.kv_cache[1].float() * 0.5
    k_scale, v_scale = k.abs().amax() / 200, v.abs().amax() / 100
    return batch, quantize_fp8(k, k_scale), quantize_fp8(v, v_scale), k_scale, v_scale


def _reference(batch: object, k8: torch.Tensor, v8: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor):
    """float64 attention over the dequantized cache (stored * scale), through the block table."""
    q = batch.q.double()
    out = torch.empty_like(q)
    return paged_attention_reference(
        q,
        k8.double() * k_scale.double(),
        v8.double() * v_scale.double(),
        out,
        batch.query_start_loc.tolist(),
        batch.seq_lens.tolist(),
        batch.block_table,
        q.shape[2] ** -0.5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_cache_matches_float64(dtype: torch.dtype) -> None:
    batch, k8, v8, k_scale, v_scale = _fp8_batch(dtype, seed=2)
    expected = _reference(batch, k8, v8, k_scale, v_scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    # TORCH_REF's function with the scales
    ref_out = torch.empty_like(batch.q)
    meta = (batch.query_start_loc.tolist(), batch.seq_lens.tolist(), batch.block_table, batch.q.shape[2] ** -0.5)
    paged_attention_reference(batch.q, k8, v8, ref_out, *meta, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(ref_out.double(), expected, atol=tol, rtol=tol)
    # TRITON_ATTN's kernel
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, k8, v8, out, **batch.attention_kwargs(), k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # Reading the fp8 bytes without their scales is far off: the scales are what makes it right.
    wrong = torch.empty_like(batch.q)
    paged_attention_reference(batch.q, k8.to(dtype), v8.to(dtype), wrong, *meta)
    assert (wrong.double() - expected).abs().max() > 0.5


def test_split_kv_decode_over_an_fp8_cache_matches_float64() -> None:
    batch = random_paged_batch([1, 1, 1], [40, 17, 63], head_size=32, block_size=4, seed=3)
    k, v = batch.kv_cache[0] * 2.0, batch.kv_cache[1] * 0.25
    k_scale, v_scale = k.abs().amax() / 200, v.abs().amax() / 100
    k8, v8 = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    expected = _reference(batch, k8, v8, k_scale, v_scale)
    out = torch.empty_like(batch.q)
    unified_attention(
        batch.q,
        k8,
        v8,
        out,
        **batch.attention_kwargs(),
        config=KernelConfig(16, 16, 4, 1, 3),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_kernels_refuse_an_fp8_cache_without_scales() -> None:
    batch, k8, v8, _, _ = _fp8_batch(torch.float32, seed=4)
    with pytest.raises(ValueError, match="needs k_scale"):
        unified_attention(batch.q, k8, v8, torch.empty_like(batch.q), **batch.attention_kwargs())
    key = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="needs k_scale"):
        reshape_and_cache(key, key, k8, v8, torch.tensor([0, 1]))


def test_selector_reasons_for_an_fp8_cache() -> None:
    layer = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=FP8, block_size=16, device_type="cuda")
    assert TorchRefBackend.validate_configuration(**layer) == []
    assert not [r for r in TritonAttentionBackend.validate_configuration(**layer) if "dtype" in r]
    flash = FlashAttentionBackend.validate_configuration(**layer)
    assert any("Blackwell" in r for r in flash), flash
    mla = TritonMLABackend.validate_configuration(**dict(layer, head_size=576, use_mla=True))
    assert any("KV cache dtype torch.float8_e4m3fn not supported" in r for r in mla), mla
    # A cache of another unquantized dtype than the model's stays refused.
    fp16_cache = TritonAttentionBackend.validate_configuration(**dict(layer, kv_cache_dtype=torch.float16))
    assert any("must equal the model dtype" in r for r in fp16_cache)


def test_kv_cache_dtype_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype 'fp8_e5m2'"):
        LLM("tiny", kv_cache_dtype="fp8_e5m2", num_kv_blocks=8)
    with pytest.raises(TypeError, match="kv_cache_dtype must be a name"):
        LLM("tiny", kv_cache_dtype=torch.float8_e4m3fn, num_kv_blocks=8)  # type: ignore[arg-type]


def test_given_scales_are_kept_and_the_other_layers_calibrated() -> None:
    first = "model.layers.0.self_attn.attn"
    llm = LLM("tiny", kv_cache_dtype="fp8", num_kv_blocks=8, kv_cache_scales={first: (0.5, 0.25)})
    layers = llm.runner.attn_layers
    assert (layers[first]._k_scale.item(), layers[first]._v_scale.item()) == (0.5, 0.25)
    assert all(layer._k_scale.item() not in (1.0, 0.5) for name, layer in layers.items() if name != first)
    with pytest.raises(ValueError, match="kv_cache_scales names no attention layer"):
        LLM("tiny", kv_cache_dtype="fp8", num_kv_blocks=8, kv_cache_scales={"model.layers.9.attn": (1.0, 1.0)})
    with pytest.raises(ValueError, match="is for an fp8 KV cache"):
        LLM("tiny", num_kv_blocks=8, kv_cache_scales={first: (1.0, 1.0)})
    with pytest.raises(ValueError, match="two positive floats"):
        LLM("tiny", kv_cache_dtype="fp8", num_kv_blocks=8, kv_cache_scales={first: (0.0, 1.0)})


def test_a_draft_models_layers_are_calibrated_too() -> None:
    """Before: the profile run ran the target model only, and the draft model's layers kept scale 1.0.
    A draft with the target's own weights sees the same tokens: each of its layers gets the scales of
    the target layer it copies."""
    llm = LLM(
        "tiny",
        kv_cache_dtype="fp8",
        num_kv_blocks=16,
        speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2},
    )
    layers = llm.runner.attn_layers
    drafts = {name: layer for name, layer in layers.items() if name.startswith(DRAFT_PREFIX)}
    assert drafts and len(drafts) * 2 == len(layers)
    for name, draft in drafts.items():
        target = layers[name.removeprefix("draft.")]  # draft.model.layers.0... copies model.layers.0...
        assert (draft._k_scale.item(), draft._v_scale.item()) == (target._k_scale.item(), target._v_scale.item())
        assert draft._k_scale.item() != 1.0 and not draft.calculate_kv_scales


PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(12 + i % 5)]} for i in range(24)]


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {dt: LLM("tiny", kv_cache_dtype=dt, num_kv_blocks=96, max_num_seqs=24) for dt in ("auto", "fp8")}


def test_scales_come_from_the_profile_run_per_layer(engines: dict[str, LLM]) -> None:
    layers = list(engines["fp8"].runner.attn_layers.values())
    k_scales = [layer._k_scale.item() for layer in layers]
    v_scales = [layer._v_scale.item() for layer in layers]
    assert all(s != 1.0 and math.isfinite(s) and s > 0 for s in k_scales + v_scales)
    assert len(set(k_scales)) == len(layers) and len(set(v_scales)) == len(layers)  # per layer
    assert all(k != v for k, v in zip(k_scales, v_scales))
    assert not any(layer.calculate_kv_scales for layer in layers)
    auto = list(engines["auto"].runner.attn_layers.values())
    assert all(layer._k_scale.item() == 1.0 and not layer.calculate_kv_scales for layer in auto)
    cache = next(iter(engines["fp8"].runner.kv_caches.values()))
    assert cache.dtype == FP8 and cache.element_size() == 1


def test_llm_with_an_fp8_cache_mostly_agrees_with_the_fp32_cache(engines: dict[str, LLM]) -> None:
    """One greedy token per prompt (a position-wise comparison: no divergence cascades), then a
    longer continuation, compared position by position (one early flip changes the rest). Measured
    here on tiny (random weights, near-tied logits): 24 of 24 first tokens, 63 of 128 continuation
    tokens (49%); the bounds sit a little below."""
    one = SamplingParams(temperature=0, max_tokens=1)
    firsts = {dt: [o.outputs[0].token_ids[0] for o in llm.generate(PROMPTS, one)] for dt, llm in engines.items()}
    assert sum(a == b for a, b in zip(firsts["auto"], firsts["fp8"])) >= 22
    many = SamplingParams(temperature=0, max_tokens=16)
    outs = {dt: [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], many)] for dt, llm in engines.items()}
    same = sum(a == b for x, y in zip(outs["auto"], outs["fp8"]) for a, b in zip(x, y))
    assert same >= 0.4 * 8 * 16, same


def test_triton_attn_engine_with_an_fp8_cache_gives_torch_ref_tokens(engines: dict[str, LLM]) -> None:
    """TRITON_ATTN's impl (scatter and kernel, both with the layer's scales) in the engine: the same
    greedy tokens as TORCH_REF over the same fp8 cache (same scales: the same profile run)."""
    triton = LLM("tiny", kv_cache_dtype="fp8", num_kv_blocks=32, max_num_seqs=4, attention_backend="TRITON_ATTN")
    params = SamplingParams(temperature=0, max_tokens=4)
    got = [o.outputs[0].token_ids for o in triton.generate(PROMPTS[:3], params)]
    want = [o.outputs[0].token_ids for o in engines["fp8"].generate(PROMPTS[:3], params)]
    assert got == want
    ref_layers = engines["fp8"].runner.attn_layers
    for name, layer in triton.runner.attn_layers.items():
        torch.testing.assert_close(layer._k_scale, ref_layers[name]._k_scale)


@pytest.mark.slow
def test_fp8_benchmark_smoke_run_reports_errors_and_agreement(tmp_path: Path) -> None:
    """benchmarks/fp8_kv_cache.py --smoke: the fp8 cache's logits are further from the float64 oracle than
    the model-dtype cache's (yet finite), and its greedy agreement is a fraction."""
    result = smoke_run("fp8_kv_cache.py", tmp_path / "fp8.json")
    auto, fp8 = result["caches"]["auto"], result["caches"]["fp8"]
    assert 0 < auto["max_logit_error"] < fp8["max_logit_error"] < 100
    assert fp8["bytes_per_block"] * 4 == auto["bytes_per_block"]  # float32 model: 4 bytes -> 1
    assert 0 <= result["greedy_token_agreement"] <= 1
