"""FusedMoE (stacked routed experts) against each expert run alone in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.models import fused_moe
from pagedkv.models.fused_moe import FusedMoE, expert_params_mapping, grouped_mm_supported
from pagedkv.models.parallel_layers import load_hf_weights

E, H, I = 5, 16, 12  # H != I: a transposed down_proj cannot line up; rows of 16-byte multiples


def hf_expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"experts.{e}.{name}.weight": torch.randn(shape, generator=gen, dtype=torch.float64) / shape[1] ** 0.5
        for e in range(E)
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))
    }


class Holder(torch.nn.Module):
    """Names the experts as a DeepSeek layer does: mlp.experts.w13_weight, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.ModuleDict({"experts": FusedMoE(E, H, I)})


def loaded_experts(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64) -> FusedMoE:
    holder = Holder().to(dtype)
    load_hf_weights(holder, ((f"mlp.{k}", v) for k, v in tensors.items()), expert_params_mapping(E))
    return holder.mlp["experts"]


def routing(tokens: int, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Router outputs: weights and distinct expert ids [tokens, top_k]; expert 4 gets no token."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=gen, dtype=torch.float64), ids


def reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, tensors: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Each token through each of its experts alone, in float64: sum_k weight_k * expert_k(x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            w = {n: tensors[f"experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}
            xt = x[t].double()
            out[t] += weight * F.linear(
                F.silu(F.linear(xt, w["gate_proj"])) * F.linear(xt, w["up_proj"]), w["down_proj"]
            )
    return out


@pytest.mark.parametrize("chunk_elements", [fused_moe.CHUNK_ELEMENTS, 3 * E * 2 * I])  # one chunk; chunks of 3
def test_dense_way_matches_experts_run_one_by_one(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    monkeypatch.setattr(fused_moe, "CHUNK_ELEMENTS", chunk_elements)
    tensors = hf_expert_tensors()
    experts = loaded_experts(tensors)
    experts.process_weights_after_loading()
    assert not experts.use_grouped_mm  # float64: no torch._grouped_mm
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weights, ids = routing(10)
    torch.testing.assert_close(experts(x, weights, ids), reference(x, weights, ids, tensors), rtol=1e-12, atol=1e-12)


def test_grouped_way_matches_experts_run_one_by_one() -> None:
    if not grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU torch._grouped_mm")
    tensors = hf_expert_tensors()
    experts = loaded_experts(tensors, torch.float32)
    experts.process_weights_after_loading()
    assert experts.use_grouped_mm
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(10)
    got = experts(x, weights.float(), ids)
    torch.testing.assert_close(got.double(), reference(x, weights, ids, tensors), rtol=1e-5, atol=1e-5)
    experts.use_grouped_mm = False  # the dense way agrees
    torch.testing.assert_close(experts(x, weights.float(), ids), got, rtol=1e-5, atol=1e-5)


def test_every_expert_tensor_lands_in_its_slot() -> None:
    tensors = hf_expert_tensors()
    experts = loaded_experts(tensors)
    for e in range(E):
        torch.testing.assert_close(experts.w13_weight[e, :I], tensors[f"experts.{e}.gate_proj.weight"])
        torch.testing.assert_close(experts.w13_weight[e, I:], tensors[f"experts.{e}.up_proj.weight"])
        torch.testing.assert_close(experts.w2_weight[e], tensors[f"experts.{e}.down_proj.weight"])


def test_missing_expert_and_bad_shapes_are_named() -> None:
    tensors = hf_expert_tensors()
    del tensors["experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors, e\.g\. \[\"mlp\.experts\.w13_weight#\(3, 'w3'\)\"\]"):
        loaded_experts(tensors)
    tensors = hf_expert_tensors()
    tensors["experts.1.down_proj.weight"] = tensors["experts.1.down_proj.weight"].T
    with pytest.raises(
        ValueError,
        match=r"Shape mismatch loading expert 1 w2: this rank's slice \(12, 16\), "
        r"parameter \(16, 12\)",
    ):
        loaded_experts(tensors)
    with pytest.raises(ValueError, match=r"FusedMoE loads one expert at a time.*got 0"):
        experts = FusedMoE(E, H, I)
        experts.weight_loader(experts.w2_weight, torch.zeros(H, I), 0)


def test_rows_grouped_mm_cannot_stride_take_the_dense_way() -> None:
    experts = FusedMoE(2, 12, 7)  # 48-byte rows of x, but 28-byte rows of the activations
    experts.process_weights_after_loading()
    assert not experts.use_grouped_mm


def test_a_moe_models_experts_register_and_are_found_by_type() -> None:
    """FusedMoE layers register in the static forward context under their prefix, as attention layers
    do; a lookup by type finds each kind, and the runner's attention layers are the attention ones only."""
    from pagedkv import LLM
    from pagedkv.attention.layer import Attention
    from pagedkv.forward_context import get_layers_from_config

    llm = LLM("tiny-mla", num_kv_blocks=16)
    experts = get_layers_from_config(llm.config, FusedMoE)
    assert list(experts) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]  # layer 0 is dense
    assert all(llm.runner.model.get_submodule(name) is layer for name, layer in experts.items())
    attention = get_layers_from_config(llm.config, Attention)
    assert list(attention) == list(llm.runner.attn_layers) == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert set(llm.config.compilation_config.static_forward_context) == set(attention) | set(experts)


def test_experts_names_are_unique() -> None:
    from pagedkv.config import EngineConfig, ModelConfig, set_current_engine_config

    with set_current_engine_config(EngineConfig(ModelConfig(model="standalone"))):
        FusedMoE(E, H, I, prefix="model.layers.1.mlp.experts")
        with pytest.raises(ValueError, match=r"Duplicate layer name: model\.layers\.1\.mlp\.experts"):
            FusedMoE(E, H, I, prefix="model.layers.1.mlp.experts")
