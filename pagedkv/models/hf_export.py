"""The engine's Llama-family model as a Hugging Face `transformers` model with the same weights.

Two users: the engine tests' logits oracle (`tests/reference.py`: float64 on the CPU, eager
attention) and the end-to-end benchmark's peers (`benchmarks/end_to_end.py`: bf16 on the GPU,
the same random `llama3-8b` weights that pagedkv serves).

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; transformers keeps them
apart, so those matrices are split back (row slices: views, no copy). The transformers model
is built on the meta device and then takes the tensors themselves (`assign=True`), so a model
already in the target dtype and device is shared, not copied: an 8B model costs no second
16 GB.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.models.configs import Qwen3Config
from pagedkv.models.llama import LlamaForCausalLM


def to_transformers(
    model: LlamaForCausalLM,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    attn_implementation: str = "eager",
) -> torch.nn.Module:
    """A `transformers` model computing what `model` computes, in `dtype` on `device`, eval mode.

    Qwen3 models become `Qwen3ForCausalLM`; other full-attention models `LlamaForCausalLM`; other
    models with sliding-window layers `Qwen2ForCausalLM` (Llama plus per-layer `layer_types`) with
    zero q/k/v biases. Weights already in `dtype` on `device` are shared with `model`. In float64
    every floating buffer (RoPE's inverse frequencies) is float64 too; otherwise they stay float32,
    as transformers keeps them.
    """
    import transformers  # optional: only the tests and the benchmark need it

    config, cls = _transformers_config(model, attn_implementation)
    weights = model.hf_state_dict()
    device = torch.device(device)
    with torch.device("meta"):
        hf = cls(config)
    if isinstance(hf, transformers.Qwen2ForCausalLM):
        for name, param in hf.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                weights.setdefault(name, torch.zeros(param.shape))
    hf.load_state_dict({k: v.to(device, dtype) for k, v in weights.items()}, strict=True, assign=True)
    with torch.device(device):  # the only non-persistent buffers: RoPE's, computed from the config
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    if dtype == torch.float64:
        hf.to(torch.float64)
    return hf.eval()


def _transformers_config(model: LlamaForCausalLM, attn_implementation: str) -> tuple[Any, type]:
    import transformers

    c = model.config
    windows = {c.layer_sliding_window(i) for i in range(c.num_hidden_layers)} - {None}
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    fields: dict[str, Any] = dict(  # what the three transformers configs below share
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=rope,
        attn_implementation=attn_implementation,
    )
    layer_types = [
        "full_attention" if c.layer_sliding_window(i) is None else "sliding_attention"
        for i in range(c.num_hidden_layers)
    ]
    if len(windows) > 1:
        raise NotImplementedError("the export maps one window size onto transformers' layer_types")
    if isinstance(c, Qwen3Config):  # q_norm / k_norm: only transformers' Qwen3 has them
        qwen3 = transformers.Qwen3Config(
            **fields,
            attention_bias=c.attention_bias,
            use_sliding_window=bool(windows),
            sliding_window=next(iter(windows), None),
            layer_types=layer_types,
        )
        return qwen3, transformers.Qwen3ForCausalLM
    if not windows:
        llama = transformers.LlamaConfig(**fields, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
        return llama, transformers.LlamaForCausalLM
    if c.attention_bias or c.mlp_bias:
        raise NotImplementedError("the export maps no o_proj/MLP biases onto Qwen2")
    qwen2 = transformers.Qwen2Config(
        **fields, sliding_window=windows.pop(), use_sliding_window=True, layer_types=layer_types
    )
    return qwen2, transformers.Qwen2ForCausalLM
