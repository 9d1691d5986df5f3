"""FusedMoE (stacked routed experts) against each expert run alone in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.models import fused_moe
from pagedkv.models.fused_moe import FusedMoE, expert_params_mapping
from pagedkv.models.parallel_layers import load_hf_weights

E, H, I = 5, 12, 7  # odd sizes: a mixed-up gate/up split or a transposed down_proj cannot line up


def hf_expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"experts.{e}.{name}.weight": torch.randn(shape, generator=gen, dtype=torch.float64) / shape[1] ** 0.5
            for e in range(E) for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}


class Holder(torch.nn.Module):
    """Names the experts as a DeepSeek layer does: mlp.experts.w13_weight, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.ModuleDict({"experts": FusedMoE(E, H, I)})


def loaded_experts(tensors: dict[str, torch.Tensor]) -> FusedMoE:
    holder = Holder().double()
    load_hf_weights(holder, ((f"mlp.{k}", v) for k, v in tensors.items()), expert_params_mapping(E))
    return holder.mlp["experts"]


def reference(x: torch.Tensor, combine: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum_e combine[:, e] * down_e(silu(gate_e(x)) * up_e(x)), one expert at a time."""
    out = torch.zeros_like(x)
    for e in range(E):
        w = {n: tensors[f"experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}
        y = F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
        out += combine[:, e, None] * y
    return out


@pytest.mark.parametrize("chunk_elements", [fused_moe.CHUNK_ELEMENTS, 3 * E * 2 * I])  # one chunk; chunks of 3
def test_matches_experts_run_one_by_one(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    monkeypatch.setattr(fused_moe, "CHUNK_ELEMENTS", chunk_elements)
    tensors = hf_expert_tensors()
    experts = loaded_experts(tensors)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, H, generator=gen, dtype=torch.float64)
    combine = torch.rand(10, E, generator=gen, dtype=torch.float64)
    combine[combine < 0.5] = 0.0  # most tokens skip most experts, as routing leaves them
    torch.testing.assert_close(experts(x, combine), reference(x, combine, tensors), rtol=1e-12, atol=1e-12)


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
    with pytest.raises(ValueError, match=r"Shape mismatch loading expert 1 w2: this rank's slice \(7, 12\), "
                                         r"parameter \(12, 7\)"):
        loaded_experts(tensors)
    with pytest.raises(ValueError, match=r"FusedMoE loads one expert at a time.*got 0"):
        experts = FusedMoE(E, H, I)
        experts.weight_loader(experts.w2_weight, torch.zeros(H, I), 0)
