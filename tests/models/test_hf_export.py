"""`pagedkv.models.hf_export`: the engine's model as a transformers model on the same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.models.hf_export import to_transformers
from tests.conftest import write_hf_llama

pytest.importorskip("transformers")


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid", "qwen3-directory"])
def test_export_shares_weights_and_computes_the_same_logits(model: str, tmp_path: Path) -> None:
    if model == "qwen3-directory":  # q_norm / k_norm must reach transformers' Qwen3ForCausalLM
        model = str(write_hf_llama(tmp_path / "qwen3", family="Qwen3", vocab_size=320, head_dim=24))
    llm = LLM(model, device="cpu", dtype="float32", attention_backend="TORCH_REF", num_kv_blocks=64)
    hf = to_transformers(llm.model, dtype=torch.float32, attn_implementation="sdpa")
    tensors = [*hf.parameters(), *hf.buffers()]
    assert not any(t.is_meta for t in tensors), "every tensor must be real (RoPE's buffers included)"
    ours, theirs = llm.model.model.layers[0], hf.model.layers[0]
    # Same dtype and device: the export takes the engine's own storage, no copy (q is a row
    # slice of the fused qkv_proj, o_proj the very same tensor).
    assert theirs.self_attn.o_proj.weight.data_ptr() == ours.self_attn.o_proj.weight.data_ptr()
    assert theirs.self_attn.q_proj.weight.data_ptr() == ours.self_attn.qkv_proj.weight.data_ptr()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32

    ids = torch.tensor([[3, 17, 250, 9, 41, 5, 77, 120, 8, 64] * 5])
    captured: list[torch.Tensor] = []
    detach = llm.add_step_listener(lambda event: captured.append(event.result.logits[0].clone()))
    llm.generate([{"prompt_token_ids": ids[0].tolist()}], SamplingParams(temperature=0, max_tokens=1))
    detach()
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    torch.testing.assert_close(captured[0], expected, atol=2e-4, rtol=1e-4)


def test_float64_export_is_a_float64_copy() -> None:
    llm = LLM("tiny", device="cpu", dtype="float32", attention_backend="TORCH_REF", num_kv_blocks=64)
    hf = to_transformers(llm.model)
    assert {t.dtype for t in [*hf.parameters(), *hf.buffers()]} == {torch.float64}
    ours = llm.model.model.layers[0].self_attn.o_proj.weight
    assert hf.model.layers[0].self_attn.o_proj.weight.data_ptr() != ours.data_ptr()
