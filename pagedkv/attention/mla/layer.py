"""`MLAAttention`: the attention layer of multi-head latent attention models (DeepSeek-V2/V3).

It is an `Attention` in every way the engine sees: registered by name in the static forward
context, a backend chosen by the selector (an MLA one), an impl, a KV cache spec, a cache
view bound by the runner, two custom ops that find everything by the layer name. What differs
is what it is given and what it caches:

    model file:  q (RoPE applied) ──────────────────────┐
                 kv_c_normed [T, kv_lora_rank] ─┐        ├─ self.attn(q, kv_c_normed, k_pe) ─ o_proj
                 k_pe [T, rope] (RoPE applied) ─┴────────┘
    layer:       unified_mla_kv_cache_update(kv_c_normed, k_pe, name)   cache row [c_kv | k_pe]
                 unified_mla_attention_with_output(q, kv_c_normed, k_pe, out, name, dep)
                   -> impl.forward: decodes by forward_mqa, prefills by forward_mha
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.attention import ops
from pagedkv.attention.backend import AttentionBackend, AttentionImpl
from pagedkv.attention.layer import Attention
from pagedkv.attention.mla.common import MLACommonImpl, MLADims
from pagedkv.kv_cache.spec import KVCacheSpec, MLAAttentionSpec


class MLAAttention(Attention):
    """Attention over a latent cache (one row of kv_lora_rank + rope values per token)."""

    impl: MLACommonImpl[Any]
    kv_b_proj: nn.Module
    """The model's kv_b_proj, held outside `_modules` (see __init__); a declaration, no class attribute."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        kv_b_proj: nn.Module,
        *,
        prefix: str,
        attn_backend: type[AttentionBackend] | None = None,
    ) -> None:
        # Set before Attention.__init__, which selects the backend and makes the impl with them.
        self.mla_dims = MLADims(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        super().__init__(
            num_heads, self.mla_dims.latent_size, scale, num_kv_heads=1, prefix=prefix, attn_backend=attn_backend
        )
        # Not a submodule: the model's attention module owns kv_b_proj and its weight; this
        # layer only reads it (`process_weights_after_loading`), so the weight is listed once.
        self.__dict__["kv_b_proj"] = kv_b_proj

    def make_impl(self) -> AttentionImpl[Any]:
        if not self.attn_backend.is_mla:
            raise ValueError(
                f"Attention backend {self.attn_backend.get_name()} is not an MLA backend; layer "
                f"{self.layer_name!r} needs one (TORCH_REF_MLA, TRITON_MLA)."
            )
        return self.attn_backend.get_impl_cls()(  # type: ignore[call-arg]
            self.num_heads,
            self.head_size,
            self.scale,
            1,
            None,
            self.kv_cache_dtype,
            self.attn_type,
            mla_dims=self.mla_dims,
        )

    def selector_kwargs(self) -> dict[str, Any]:
        return {**super().selector_kwargs(), "use_mla": True}

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return MLAAttentionSpec(self.block_size, 1, self.mla_dims.latent_size, self.kv_cache_dtype)

    def process_weights_after_loading(self) -> None:
        """Hand the loaded kv_b_proj weight to the impl, which splits it into W_UK and W_UV."""
        weight = self.kv_b_proj.weight
        # nn.Module's attributes type as `Tensor | Module`; a linear layer's weight is a Parameter.
        assert isinstance(weight, torch.Tensor), f"kv_b_proj.weight is a {type(weight).__name__}, not a tensor"
        self.impl.process_weights_after_loading(weight)

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q [T, heads * qk_head_dim], kv_c_normed [T, kv_lora_rank], k_pe [T, rope] -> [T, heads * v_head_dim]."""
        dims = self.mla_dims
        output = torch.empty(q.shape[0], self.num_heads * dims.v_head_dim, dtype=q.dtype, device=q.device)
        q = q.view(-1, self.num_heads, dims.qk_head_dim)
        out_heads = output.view(-1, self.num_heads, dims.v_head_dim)
        if self.use_direct_call:
            ops.kv_cache_update(kv_c_normed, k_pe, self.layer_name)
            ops.attention_with_output(q, kv_c_normed, k_pe, out_heads, self.layer_name)
            return output
        dummy_dep = torch.ops.pagedkv.unified_mla_kv_cache_update(kv_c_normed, k_pe, self.layer_name)
        torch.ops.pagedkv.unified_mla_attention_with_output(
            q, kv_c_normed, k_pe, out_heads, self.layer_name, kv_cache_dummy_dep=dummy_dep
        )
        return output

    def extra_repr(self) -> str:
        d = self.mla_dims
        return (
            f"name={self.layer_name!r}, heads={self.num_heads}, kv_lora_rank={d.kv_lora_rank}, "
            f"qk_nope={d.qk_nope_head_dim}, qk_rope={d.qk_rope_head_dim}, v={d.v_head_dim}, "
            f"backend={self.attn_backend.get_name()}"
        )
