"""The routed experts of a mixture-of-experts layer, stacked into two weights (vLLM's FusedMoE layout).

A checkpoint stores each expert as its own SwiGLU MLP (gate_proj, up_proj, down_proj). Run one
after another, a layer of 64 experts is ~320 small kernels per step. Stacked, all experts are
two matmuls:

    w13_weight [E, 2I, H]: expert e's gate rows, then its up rows ("w1" and "w3" in vLLM's names)
    w2_weight  [E, H, I]:  expert e's down_proj ("w2")

    x [T, H] ── x @ w13ᵀ ──> [T, E, 2, I] ── silu(gate) * up * combine[t, e] ──> [T, E, I]
                                                                                    │
                             out [T, H] <── sum over e <── per expert: @ w2[e]ᵀ ─────┘

`combine[t, e]` is token t's router weight for expert e, 0 where the token was not routed there.
Every expert thus runs on every token (E / top_k times the FLOPs of running each token through
its own experts only), but nothing depends on the routing's shape: no host sync, and CUDA graphs
capture the layer. At decode the step reads every expert's weights anyway; prefill pays the
extra FLOPs. vLLM's fused_moe kernel gathers each expert's tokens instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.parallel_layers import ShardId, copy_checked

CHUNK_ELEMENTS = 2**25
"""Tokens run in chunks whose [tokens, E, 2I] intermediate holds at most this many values
(64 MB in bf16), so a long prefill does not need E times the activations of a dense MLP."""


def expert_params_mapping(num_experts: int) -> dict[str, tuple[str, ShardId]]:
    """`load_hf_weights`' `stacked` entries routing Hugging Face expert tensors into `FusedMoE`:
    "...experts.3.up_proj.weight" -> parameter "...experts.w13_weight", shard (3, "w3")."""
    return {f".experts.{e}.{hf}.": (f".experts.{param}_", (e, shard))
            for e in range(num_experts)
            for hf, param, shard in (("gate_proj", "w13", "w1"), ("up_proj", "w13", "w3"), ("down_proj", "w2", "w2"))}


class FusedMoE(nn.Module):
    """All routed experts of one layer in two stacked weights; `forward` runs every expert at once."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy one expert's gate_proj ("w1"), up_proj ("w3") or down_proj ("w2") into its slot."""
        if not (isinstance(shard_id, tuple) and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"FusedMoE loads one expert at a time: shard (expert < {self.num_experts}, "
                             f"'w1' | 'w3' | 'w2'), got {shard_id!r}")
        expert, which = shard_id
        target = param.data[expert]
        if which != "w2":  # gate rows first, then up rows
            target = target.narrow(0, 0 if which == "w1" else self.intermediate_size, self.intermediate_size)
        copy_checked(target, loaded, f"expert {expert} {which}")

    def forward(self, x: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], combine [tokens, experts] (router weights, 0 where not routed) -> [tokens, hidden]."""
        experts, two_i, hidden = self.w13_weight.shape
        w13 = self.w13_weight.view(experts * two_i, hidden)
        w2_t = self.w2_weight.transpose(1, 2)  # [E, I, H] as a view: bmm reads it transposed
        out = torch.empty_like(x)
        step = max(1, CHUNK_ELEMENTS // (experts * two_i))
        for start in range(0, x.shape[0], step):  # host-side sizes only: the same chunks at capture and replay
            chunk = slice(start, start + step)
            gate, up = F.linear(x[chunk], w13).view(-1, experts, 2, self.intermediate_size).unbind(2)
            act = F.silu(gate) * up * combine[chunk, :, None].to(x.dtype)  # [tokens, E, I]
            out[chunk] = torch.bmm(act.transpose(0, 1), w2_t).sum(0)  # [E, tokens, H] summed over experts
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.w13_weight.shape[2]}, intermediate={self.intermediate_size}"
