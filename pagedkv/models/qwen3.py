"""Qwen3: Llama with QK-norm, as vllm/model_executor/models/qwen3.py builds it on Qwen2's classes.

The only change to the computation is an RMSNorm over each head of q and of k, between the
projection and RoPE:

    hidden ─ qkv_proj ─┬─ q ─ q_norm (per head) ─ RoPE ─┐
                       ├─ k ─ k_norm (per head) ─ RoPE ─┼─ self.attn(q, k, v) ─ o_proj ─ out
                       └─ v ────────────────────────────┘

Normalising each head keeps the attention logits q.k bounded however large the projections grow
(the Qwen3 report's reason: stable training without Qwen2's q/k/v biases). Everything else --
MLP, decoder layer, weight loading, tensor parallelism -- is Llama's (pagedkv/models/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedkv.models.layers import RMSNorm
from pagedkv.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM


@dataclass
class Qwen3Config(LlamaConfig):
    """Llama's fields, with the defaults of transformers' Qwen3Config for keys a config.json leaves out.

    `head_dim` is a field of its own (128 by default), not hidden_size / num_attention_heads:
    Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024. `attention_bias` (default False)
    puts biases on q/k/v and o_proj, as Llama's flag does; the MLP has none. Sliding windows are
    read as Qwen2's (`_hf_windows`).
    """

    architecture: ClassVar[str] = "Qwen3ForCausalLM"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None


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
