"""Llama, written the way a serving engine wants it.

The attention module holds the math a checkpoint defines -- fused qkv projection, RoPE,
output projection -- and hands the rest to the generic `Attention` layer:

    hidden ─ qkv_proj ─┬─ q ─ RoPE ─┐
                       ├─ k ─ RoPE ─┼─ self.attn(q, k, v) ─ o_proj ─ out
                       └─ v ────────┘

No block table, slot mapping or batch shape appears here: `self.attn` finds them in the
forward context by its name, e.g. "model.layers.3.self_attn.attn". The sizes come from a
`LlamaConfig` (pagedkv/models/configs.py: the fields read off a checkpoint's config.json).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagedkv.attention.layer import Attention
from pagedkv.models.configs import LlamaConfig
from pagedkv.models.layers import RMSNorm, SiluAndMul, get_rope, share_rotary_embeddings
from pagedkv.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_hf_weights,
)


class LlamaAttention(nn.Module):
    """qkv_proj -> RoPE -> Attention -> o_proj, with this rank's share of the heads."""

    def __init__(self, config: LlamaConfig, prefix: str, sliding_window: int | None) -> None:
        super().__init__()
        # LlamaConfig.__post_init__ fills in what config.json may leave out.
        assert config.head_dim is not None and config.num_key_value_heads is not None and config.qkv_bias is not None
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.layout.num_heads, self.qkv_proj.layout.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(
        self,
        config: LlamaConfig,
        prefix: str,
        sliding_window: int | None,
        attention_type: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_type(config, f"{prefix}.self_attn", sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(
        self, config: LlamaConfig, prefix: str = "model", attention_type: type[LlamaAttention] = LlamaAttention
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        with share_rotary_embeddings():  # one cos/sin table for all layers
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(config, f"{prefix}.layers.{i}", config.layer_sliding_window(i), attention_type)
                for i in range(config.num_hidden_layers)
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


# Hugging Face keeps q/k/v and gate/up as separate matrices; we fuse them.
# hf name part -> (our fused name part, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """The whole model: tokens + positions -> hidden states -> logits."""

    keep_in_float32: ClassVar[tuple[str, ...]] = ()
    """Parameters (name endings) that stay float32 in a bf16/fp16 engine: none here (DeepSeek: its router)."""
    attention_type: ClassVar[type[LlamaAttention]] = LlamaAttention
    """The attention module of every layer: a family that only changes attention (Qwen3) swaps it."""

    def __init__(self, config: LlamaConfig, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, prefix, attention_type=self.attention_type)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:  # both split by vocabulary rows the same way
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (all requests packed) -> hidden [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under Hugging Face's names: the fused qkv_proj / gate_up_proj
        split back into q/k/v_proj and gate/up_proj (views, no copies). The inverse of `load_weights`
        for one rank."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            for part, (fused, index) in _STACKED.items():
                if fused in name:
                    first = self.model.layers[0]
                    assert isinstance(first, LlamaDecoderLayer)  # LlamaModel's layers are all decoder layers
                    sizes = (
                        first.self_attn.qkv_proj.output_sizes
                        if fused == ".qkv_proj."
                        else first.mlp.gate_up_proj.output_sizes
                    )
                    out[name.replace(fused, part)] = tensor.split(sizes)[index]
            if not any(fused in name for fused, _ in _STACKED.values()):
                out[name] = tensor
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused, sharded) parameters: each parameter's
        `weight_loader` takes this rank's slice. Every parameter must be set."""
        load_hf_weights(self, weights, _STACKED, tied_embeddings=self.config.tie_word_embeddings)
