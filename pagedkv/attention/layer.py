"""The generic `Attention` layer: the seam between a model file and the serving machinery.

A model file owns the projections and RoPE; this layer owns the head geometry, the
backend impl and the cache contract. It never receives per-step state as arguments:

    Attention.forward(q, k, v)
      -> views [tokens, heads, head_size]
      -> torch.ops.pagedkv.unified_kv_cache_update(k, v, name)        (write new K/V)
      -> torch.ops.pagedkv.unified_attention_with_output(q, k, v, out, name, dep)
           -> get_attention_context(name): metadata, layer, kv_cache, slot mapping   (ops.py)
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedkv.attention import ops  # also registers torch.ops.pagedkv.*, which forward calls
from pagedkv.attention.backend import AttentionBackend, AttentionImpl, AttentionType
from pagedkv.attention.selector import get_attn_backend
from pagedkv.checks import check_int, check_optional_int
from pagedkv.config import get_current_engine_config
from pagedkv.forward_context import register_layer
from pagedkv.kv_cache.fp8 import K_SCALE_CONSTANT, V_SCALE_CONSTANT, is_fp8, kv_scale
from pagedkv.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.platforms import get_platform


class Attention(nn.Module):
    """Attention over the paged KV cache, registered under its layer name (`prefix`)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        prefix: str,
        sliding_window: int | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        attn_backend: type[AttentionBackend] | None = None,
    ) -> None:
        super().__init__()
        config = get_current_engine_config()
        where = f"Attention layer {prefix!r}: "
        num_heads = check_int(where + "num_heads", num_heads, low=1)
        num_kv_heads = num_heads if num_kv_heads is None else check_int(where + "num_kv_heads", num_kv_heads, low=1)
        head_size = check_int(where + "head_size", head_size, low=1)
        sliding_window = check_optional_int(where + "sliding_window", sliding_window, low=1)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}): "
                "each KV head serves the same number of query heads."
            )
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.dtype = config.model_config.dtype
        self.kv_cache_dtype = config.kv_cache_dtype
        self.block_size = config.cache_config.block_size

        self.attn_backend = attn_backend or get_attn_backend(
            **self.selector_kwargs(),
            device=config.device,
            layer_name=prefix,
            selected=config.layer_attention_backends.get(prefix, config.attention_backend),
        )
        self.impl = self.make_impl()
        # An fp8 cache stores K / _k_scale and V / _v_scale (pagedkv/kv_cache/fp8.py): float32 scalars on
        # the device, so kernels read them without a host sync and a CUDA graph sees their updates. They
        # are 1.0 unless given, as vLLM's are without calculate_kv_scales (vllm/attention/layer.py).
        given = config.cache_config.kv_cache_scales.get(prefix)
        k_scale, v_scale = given or (1.0, 1.0)
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32, device=config.device)
        self._v_scale = torch.tensor(v_scale, dtype=torch.float32, device=config.device)
        self.calculate_kv_scales = (
            is_fp8(self.kv_cache_dtype) and given is None and config.cache_config.calculate_kv_scales
        )
        """Set the scales from the next profile run's K and V (`calc_kv_scales`), then False: only with an
        fp8 cache, `calculate_kv_scales` on and no scales given for this layer (`kv_cache_scales`)."""
        opaque = config.compilation_config.opaque_attention_op
        if opaque is None:
            opaque = get_platform(config.device).opaque_attention_op()
        self.use_direct_call = not opaque

        if kv_sharing_target_layer_name is not None:
            validate_kv_sharing_target(
                prefix, kv_sharing_target_layer_name, config.compilation_config.static_forward_context, self
            )
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

        # An empty placeholder until the runner binds this layer's view of the cache.
        self.kv_cache = torch.tensor([])
        register_layer(config, prefix, self)

    def make_impl(self) -> AttentionImpl[Any]:
        """This layer's impl, made by the selected backend (MLAAttention passes more)."""
        return self.attn_backend.get_impl_cls()(
            self.num_heads,
            self.head_size,
            self.scale,
            self.num_kv_heads,
            self.sliding_window,
            self.kv_cache_dtype,
            self.attn_type,
        )

    def selector_kwargs(self) -> dict[str, Any]:
        """What the selector asks backends about this layer (`validate_configuration`'s keywords)."""
        return dict(
            head_size=self.head_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            attn_type=self.attn_type,
            sliding_window=self.sliding_window,
        )

    def calc_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The fp8 cache's scales from this K and V (the profile run's, with `calculate_kv_scales`): amax / 200
        for K, amax / 100 for V, so what it saw lands well below e4m3's 448 (vllm/attention/layer.py,
        calc_kv_scales)."""
        self._k_scale.copy_(kv_scale(key, K_SCALE_CONSTANT))
        self._v_scale.copy_(kv_scale(value, V_SCALE_CONSTANT))
        self.calculate_kv_scales = False

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Called once by the runner: this layer's view of its group's backing buffer."""
        self.kv_cache = kv_cache

    def get_kv_cache_spec(self) -> KVCacheSpec | None:
        """What one cache block of this layer holds; None when it reuses another layer's cache."""
        if self.kv_sharing_target_layer_name is not None:
            return None
        args = (self.block_size, self.num_kv_heads, self.head_size, self.kv_cache_dtype)
        if self.sliding_window is not None:
            return SlidingWindowSpec(*args, sliding_window=self.sliding_window)
        return FullAttentionSpec(*args)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """q [tokens, num_heads * head_size], k/v [tokens, num_kv_heads * head_size] -> like q."""
        output = torch.empty_like(query)
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        out_heads = output.view(-1, self.num_heads, self.head_size)
        writes_cache_separately = (
            not self.attn_backend.forward_includes_kv_cache_update and self.kv_sharing_target_layer_name is None
        )
        if self.use_direct_call:
            if writes_cache_separately:
                ops.kv_cache_update(key, value, self.layer_name)
            ops.attention_with_output(query, key, value, out_heads, self.layer_name)
            return output
        dummy_dep = None
        if writes_cache_separately:
            dummy_dep = torch.ops.pagedkv.unified_kv_cache_update(key, value, self.layer_name)
        torch.ops.pagedkv.unified_attention_with_output(
            query, key, value, out_heads, self.layer_name, kv_cache_dummy_dep=dummy_dep
        )
        return output

    def extra_repr(self) -> str:
        return (
            f"name={self.layer_name!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.attn_backend.get_name()}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
        )


def _layer_index(layer_name: str) -> int:
    match = re.search(r"\.(\d+)\.", f".{layer_name}.")
    if match is None:
        raise ValueError(f"Cannot find a layer index in layer name {layer_name!r}.")
    return int(match.group(1))


def validate_kv_sharing_target(
    layer_name: str, target_name: str, static_forward_context: dict[str, Any], layer: Attention
) -> None:
    """A layer may reuse the KV cache of an earlier Attention layer of the same type."""
    prefix = f"KV sharing target {target_name!r} of layer {layer_name!r} "
    if target_name == layer_name:
        raise ValueError(prefix + "cannot be the layer itself.")
    target = static_forward_context.get(target_name)
    if target is None:
        # Not registered yet: either it comes later in the model, or it does not exist.
        if _layer_index(target_name) >= _layer_index(layer_name):
            raise ValueError(prefix + "must come before the current layer.")
        raise ValueError(prefix + "is not a valid Attention layer in the model.")
    if not isinstance(target, Attention):
        raise ValueError(prefix + "is not a valid Attention layer in the model.")
    if type(target) is not type(layer) or target.attn_type != layer.attn_type:
        raise ValueError(
            prefix + f"must be the same type as the current layer "
            f"({type(layer).__name__}, {layer.attn_type.value}); "
            f"it is ({type(target).__name__}, {target.attn_type.value})."
        )
