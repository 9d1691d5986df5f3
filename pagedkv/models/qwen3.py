"""Qwen3: Llama with QK-norm, as vllm/model_executor/models/qwen3.py builds it on Qwen2's classes.

The only change to the computation is an RMSNorm over each head of q and of k, between the
projection and RoPE:

    hidden ─ qkv_proj ─┬─ q ─ q_norm (per head) ─ RoPE ─┐
                       ├─ k ─ k_norm (per head) ─ RoPE ─┼─ self.attn(q, k, v) ─ o_proj ─ out
                       └─ v ────────────────────────────┘

Normalising each head keeps the attention logits q.k bounded however large the projections grow
(the Qwen3 report's reason: stable training without Qwen2's q/k/v biases). Everything else --
MLP, decoder layer, weight loading, tensor parallelism -- is Llama's (pagedkv/models/llama.py); its
`Qwen3Config` (pagedkv/models/configs.py) only changes the defaults of keys a config.json leaves out.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedkv.models.configs import LlamaConfig
from pagedkv.models.layers import RMSNorm
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama's attention with an RMSNorm over each head of q and of k, before RoPE."""

    def __init__(self, config: LlamaConfig, prefix: str, sliding_window: int | None) -> None:
        super().__init__(config, prefix, sliding_window)
        # One weight of head_dim values, shared by every head: a tensor-parallel rank normalises
        # its own heads with the whole weight, so the norms are replicated, not split.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [tokens, heads * head_dim] -> [tokens, heads, head_dim]: RMSNorm reduces over one head.
        q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The whole Qwen3 model: Llama's, with `Qwen3Attention` in every layer."""

    attention_type: ClassVar[type[LlamaAttention]] = Qwen3Attention
