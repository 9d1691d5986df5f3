"""TRITON_ATTN with an fp8 (e4m3) KV cache on a CUDA GPU: the hardware cast, bf16 queries, realistic sizes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.attention.backends.torch_ref import paged_attention_reference  # noqa: E402
from pagedkv.kernels import reshape_and_cache, unified_attention  # noqa: E402
from pagedkv.kernels.testing import random_paged_batch  # noqa: E402
from pagedkv.kv_cache.fp8 import K_SCALE_CONSTANT, V_SCALE_CONSTANT, kv_scale, quantize_fp8  # noqa: E402


def test_reshape_and_cache_fp8_on_the_gpu_stores_torchs_bytes() -> None:
    """The GPU's cvt.rn.satfinite rounds as torch does; the division may differ by an fp32 ulp, so
    at most a rare value lands one e4m3 step away."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(4096, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16) * 7
    value = torch.randn(4096, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(300, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(300 * 16, device="cuda")[:4096]
    k_scale, v_scale = kv_scale(key, K_SCALE_CONSTANT), kv_scale(value, V_SCALE_CONSTANT)
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        got = cache.view(-1, 8, 128)[slots].float()
        want = quantize_fp8(new, scale).float()
        off = got != want
        assert off.float().mean() < 1e-3
        assert ((got - want).abs()[off] <= want.abs()[off] / 8 + 2**-9).all()  # one step at most


@pytest.mark.parametrize("shape", [([1] * 32, [4095] * 32), ([1] * 4 + [300], [8191] * 4 + [0])])
def test_triton_attn_bf16_over_an_fp8_cache_matches_float64(shape: tuple[list[int], list[int]]) -> None:
    query_lens, context_lens = shape
    batch = random_paged_batch(
        query_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda"
    )
    k, v = batch.kv_cache[0] * 4, batch.kv_cache[1]
    k_scale, v_scale = kv_scale(k, K_SCALE_CONSTANT), kv_scale(v, V_SCALE_CONSTANT)
    k8, v8 = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    out = torch.empty_like(batch.q)
    unified_attention(batch.q, k8, v8, out, **batch.attention_kwargs(), k_scale=k_scale, v_scale=v_scale)
    q = batch.q.double()
    expected = paged_attention_reference(
        q,
        k8.double() * k_scale.double(),
        v8.double() * v_scale.double(),
        torch.empty_like(q),
        batch.query_start_loc.tolist(),
        batch.seq_lens.tolist(),
        batch.block_table,
        q.shape[2] ** -0.5,
    )
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel < 2e-2, rel


def test_llm_fp8_cache_on_the_gpu_picks_triton_attn_and_agrees() -> None:
    """FLASH_ATTN refuses the fp8 cache (Hopper), so TRITON_ATTN serves it; first greedy tokens agree."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(40)]} for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=1)
    tokens = {}
    for cache in ("auto", "fp8"):
        llm = LLM("tiny", kv_cache_dtype=cache, num_kv_blocks=128, max_num_seqs=16)
        if cache == "fp8":
            assert {layer.attn_backend.get_name() for layer in llm.runner.attn_layers.values()} == {"TRITON_ATTN"}
        tokens[cache] = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert sum(a == b for a, b in zip(tokens["auto"], tokens["fp8"])) >= 14
