"""Llama, written the way a serving engine wants it.

The attention module holds the math a checkpoint defines -- fused qkv projection, RoPE,
output projection -- and hands the rest to the generic `Attention` layer:

    hidden ─ qkv_proj ─┬─ q ─ RoPE ─┐
                       ├─ k ─ RoPE ─┼─ self.attn(q, k, v) ─ o_proj ─ out
                       └─ v ────────┘

No block table, slot mapping or batch shape appears here: `self.attn` finds them in the
forward context by its name, e.g. "model.layers.3.self_attn.attn".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from pagedkv.attention.layer import Attention
from pagedkv.models.layers import (
    RMSNorm, SiluAndMul, check_config_numbers, get_rope, hf_rope_parameters, share_rotary_embeddings,
)
from pagedkv.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_hf_weights,
)


@dataclass
class LlamaConfig:
    """The architecture fields of a Hugging Face Llama `config.json` that this model reads."""

    architecture: ClassVar[str] = "LlamaForCausalLM"
    """The model class that serves it (`loader.MODEL_REGISTRY`), for Mistral and Qwen2 too (Qwen3: its own)."""
    supports_tensor_parallel: ClassVar[bool] = True
    use_mla: ClassVar[bool] = False
    """Attention layers are MHA / GQA / MQA (`Attention`), not MLA: MHA backends serve them."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Biases on q/k/v and o_proj (Llama's flag)."""
    qkv_bias: bool | None = None
    """Biases on q/k/v only (Qwen2); None follows `attention_bias`."""
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention" (with `sliding_window`)."""
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_config_numbers(self, floats=("rms_norm_eps", "rope_theta"), positive=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings"))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:  # e.g. Qwen3's default of 32 KV heads
            raise ValueError(f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}): each KV head serves the same "
                             "number of query heads.")
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        for name in ("attention_bias", "qkv_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):  # "yes" would build biases the checkpoint lacks
                raise ValueError(f"config.json: {name} must be true or false, got {getattr(self, name)!r}.")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={self.hidden_act!r} is not supported; Llama-family models use 'silu'.")
        self._check_windows()

    def _check_windows(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}.")
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must be a list with one entry per layer ({self.num_hidden_layers}), "
                f"got {self.layer_types!r}."
            )
        unknown = sorted({str(t) for t in self.layer_types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types has unsupported entries {unknown}; supported: {list(LAYER_TYPES)}.")

    def layer_sliding_window(self, i: int) -> int | None:
        """Layer `i`'s window: `sliding_window` on the "sliding_attention" layers, or on all if no layer_types."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], model_type: str = "llama") -> LlamaConfig:
        """Read a `config.json` of transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters).

        `model_type` is the family ("llama", "mistral", "qwen2" or "qwen3"): it decides the biases
        and how the per-layer windows are read (see `_hf_windows`).
        """
        present = {k: hf[k] for k in cls.__dataclass_fields__ if k in hf and hf[k] is not None and k != "qkv_bias"}
        kwargs = {**FAMILY_DEFAULTS.get(model_type, {}), **present}
        kwargs["rope_theta"], kwargs["rope_scaling"] = hf_rope_parameters(
            hf, cls.rope_theta, kwargs.get("max_position_embeddings", cls.max_position_embeddings))
        eos = hf.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if kwargs.get("hidden_act") == "swish":  # another name of SiLU (transformers' ACT2FN has both)
            kwargs["hidden_act"] = "silu"
        # Mistral has no biases and Qwen2 biases on q/k/v only, whatever bias keys the file has;
        # Qwen3 reads attention_bias (q/k/v and o_proj, as Llama) but never has MLP biases.
        if model_type == "mistral":
            kwargs.update(attention_bias=False, mlp_bias=False)
        elif model_type == "qwen2":
            kwargs.update(qkv_bias=True, attention_bias=False, mlp_bias=False)
        elif model_type == "qwen3":
            kwargs.update(mlp_bias=False)
        kwargs["sliding_window"], kwargs["layer_types"] = _hf_windows(hf, model_type)
        return cls(**kwargs)


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' defaults for keys a config.json leaves out, where Mistral's and Qwen2's differ
    # from Llama's (the dataclass defaults above); the windows are in `_hf_windows`.
    "mistral": dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072),
    "qwen2": dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768, bos_token_id=None),
}


LAYER_TYPES = ("full_attention", "sliding_attention")


def _hf_windows(hf: dict[str, Any], model_type: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of a `config.json`, as the installed transformers reads them.

    llama:   no window, whatever the file says.
    mistral: `sliding_window` (4096 when the key is absent, none when null) on every layer; with
             `layer_types` (AutoModel then loads it as Ministral) only on the "sliding_attention" ones.
    qwen2, qwen3: windows only when `use_sliding_window` is true (default false); `layer_types` when
             present, else full attention on layers below `max_window_layers` (default 28) and
             the window from there on (what transformers 4 wrote had no layer_types).
    """
    if model_type == "llama":
        return None, None
    window = hf.get("sliding_window", 4096)
    layer_types = hf.get("layer_types")
    if model_type == "mistral":
        return window, layer_types
    if not hf.get("use_sliding_window", False):
        return None, None
    if layer_types is None and window is not None:
        num_layers = hf.get("num_hidden_layers", LlamaConfig.num_hidden_layers)
        first_windowed = hf.get("max_window_layers", 28)
        layer_types = [LAYER_TYPES[i >= first_windowed] for i in range(num_layers)]
    return window, layer_types


class LlamaAttention(nn.Module):
    """qkv_proj -> RoPE -> Attention -> o_proj, with this rank's share of the heads."""

    def __init__(self, config: LlamaConfig, prefix: str, sliding_window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.layout.num_heads, self.qkv_proj.layout.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling)
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

    def __init__(self, config: LlamaConfig, prefix: str, sliding_window: int | None,
                 attention_type: type[LlamaAttention] = LlamaAttention) -> None:
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

    def __init__(self, config: LlamaConfig, prefix: str = "model",
                 attention_type: type[LlamaAttention] = LlamaAttention) -> None:
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
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """The whole model: tokens + positions -> hidden states -> logits."""

    keep_in_float32: ClassVar[tuple[str, ...]] = ()
    """Parameters (name endings) that stay float32 in a bf16/fp16 engine: none here (DeepSeek: its router)."""
    attention_type: ClassVar[type[LlamaAttention]] = LlamaAttention
    """The attention module of every layer: a family that only changes attention (Qwen3) swaps it."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention_type=self.attention_type)
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
                    sizes = self.model.layers[0].self_attn.qkv_proj.output_sizes if fused == ".qkv_proj." \
                        else self.model.layers[0].mlp.gate_up_proj.output_sizes
                    out[name.replace(fused, part)] = tensor.split(sizes)[index]
            if not any(fused in name for fused, _ in _STACKED.values()):
                out[name] = tensor
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused, sharded) parameters: each parameter's
        `weight_loader` takes this rank's slice. Every parameter must be set."""
        load_hf_weights(self, weights, _STACKED, tied_embeddings=self.config.tie_word_embeddings)
