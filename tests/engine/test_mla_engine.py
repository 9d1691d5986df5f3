"""MLA in the running engine: TRITON_MLA (under Triton's interpreter) and preemption, checked
against transformers' DeepSeek-V2 on the same weights, and the selector's choice for MLA layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.mla.layer import MLAAttention
from tests.conftest import needs_triton_on_cpu, write_hf_deepseek
from tests.models.test_deepseek_vs_transformers import ATOL, GREEDY, engine, hf_model, logit_errors
from tests.reference import LogitsRecorder, reference_logits

pytest.importorskip("transformers")
needs_triton = needs_triton_on_cpu("TRITON_MLA")


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_deepseek(tmp_path_factory.mktemp("mla") / "v2", version=2)


@pytest.mark.slow
@needs_triton
def test_triton_mla_chunked_and_mixed_steps_match_transformers(v2_dir: Path) -> None:
    pytest.importorskip("triton")
    llm = engine(v2_dir, attention_backend="TRITON_MLA", max_num_batched_tokens=16)
    assert all(layer.attn_backend.get_name() == "TRITON_MLA" for layer in llm.runner.attn_layers.values())
    splits: list[int] = []
    llm.add_step_listener(lambda e: splits.append(next(iter(e.result.attn_metadata.values())).num_decodes))
    error, argmax = logit_errors(llm, hf_model(v2_dir, 2))
    assert error <= ATOL and argmax
    assert max(splits) > 1  # decodes of several requests went through the Triton kernel together


@pytest.mark.slow
@needs_triton
def test_triton_mla_prefill_with_v_wider_than_k_matches_transformers(tmp_path: Path) -> None:
    """v_head_dim 32 against K's 16 + 8 = 24: forward_mha's paged kernel reads V (and writes the
    output) at V's own head size, wider than K's."""
    path = write_hf_deepseek(tmp_path / "wide-v", version=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32)
    llm = engine(path, attention_backend="TRITON_MLA", max_num_batched_tokens=16)
    impls = [layer.impl for layer in llm.runner.attn_layers.values()]
    assert all(impl.kernel_takes_heads for impl in impls)
    error, argmax = logit_errors(llm, hf_model(path, 2))
    assert error <= ATOL and argmax


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["TORCH_REF_MLA", pytest.param("TRITON_MLA", marks=needs_triton)])
def test_preemption_under_mla_loses_nothing(v2_dir: Path, backend: str) -> None:
    """Five requests in 12 usable blocks of 4 tokens: preempted, recomputed, same logits as transformers."""
    llm = LLM(str(v2_dir), device="cpu", dtype="float32", num_kv_blocks=13, block_size=4, attention_backend=backend)
    error, argmax = logit_errors(llm, hf_model(v2_dir, 2))
    assert llm.stats.num_preemptions > 0
    assert error <= ATOL and argmax
    assert llm.kv_cache_manager.num_free_blocks() == 12


def test_selector_gives_mla_layers_an_mla_backend_and_says_why_not_mha() -> None:
    llm = LLM("tiny-mla", device="cpu", num_kv_blocks=16)
    layers = llm.runner.attn_layers.values()
    assert layers and all(isinstance(layer, MLAAttention) for layer in layers)
    assert {layer.attn_backend.get_name() for layer in layers} == {"TORCH_REF_MLA"}
    spec = llm.runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert type(spec).__name__ == "MLAAttentionSpec" and spec.num_kv_heads == 1
    cache = next(iter(llm.runner.kv_caches.values()))
    assert cache.shape[1:] == (16, llm.model_config.kv_lora_rank + llm.model_config.qk_rope_head_dim)
    with pytest.raises(ValueError, match="TORCH_REF' cannot serve MLA layer .*serves MHA/GQA/MQA layers only"):
        LLM("tiny-mla", device="cpu", num_kv_blocks=16, attention_backend="TORCH_REF")
    with pytest.raises(ValueError, match="an MLA backend serves MLA layers only"):
        LLM("tiny", device="cpu", num_kv_blocks=16, attention_backend="TORCH_REF_MLA")
    text = LLM("tiny-mla", device="cpu", num_kv_blocks=16).generate(["multi-head latent"], SamplingParams(max_tokens=4))
    assert len(text[0].outputs[0].token_ids) == 4


def test_prefix_caching_under_mla_reads_shared_latent_blocks(v2_dir: Path) -> None:
    """Requests sharing a 13-token prefix: their prefills start after the cached blocks, and
    forward_mha reads those latents from the cache; logits still match transformers."""
    shared = [(5 * j) % 120 + 3 for j in range(13)]
    prompts = [shared + [(11 * i + j) % 120 + 3 for j in range(i + 1)] for i in range(4)]
    llm = engine(v2_dir, attention_backend="TORCH_REF_MLA")
    recorder = LogitsRecorder(llm)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]  # one after another
    recorder.detach()
    assert llm.stats.num_cached_tokens == 3 * 12  # blocks of 4: the prefix's 3 full blocks, for requests 2-4
    hf = hf_model(v2_dir, 2)
    for out in outs:
        expected = reference_logits(hf, out.prompt_token_ids, out.outputs[0].token_ids)
        assert (torch.stack(recorder.rows[out.request_id]) - expected).abs().max() <= ATOL
