"""The attention custom ops, registered once in the `pagedkv` torch library.

Each kind of attention layer gets a pair, a cache write and an attention: the MHA pair
(`unified_kv_cache_update`, `unified_attention_with_output`) is registered here, the MLA pair
(`unified_mla_*`) by pagedkv/attention/mla/ops.py with the same functions, four ops in all;
their qualified names are listed once in `pagedkv.config.ATTENTION_OPS`.

For torch.compile each call is one opaque node whose inputs are plain tensors and a
layer name; the op looks up everything else (layer, KV cache, metadata, slot mapping)
in the forward context. So the traced graph does not depend on Python objects that
change every step, and the compiler can split the graph at these ops.

    k, v ──> unified_kv_cache_update(k, v, name) ──> dummy (empty tensor)
                                                        │  data dependency: the
    q, k, v, out, dummy ──> unified_attention_with_output   write happens first
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedkv.attention.backend import AttentionImpl, AttentionLayer
from pagedkv.forward_context import get_forward_context
from pagedkv.library import register_op


class AttentionOpLayer(AttentionLayer, Protocol):
    """What the ops use of the layer a name resolves to (`Attention`, `MLAAttention`): its impl
    and its view of the KV cache. A protocol, so the ops need not import the layer that calls them."""

    impl: AttentionImpl[Any]
    kv_cache: torch.Tensor
    calculate_kv_scales: bool

    def calc_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None: ...


def get_attention_context(layer_name: str) -> tuple[Any, AttentionOpLayer, torch.Tensor, torch.Tensor | None]:
    """Resolve a layer name in the current forward context.

    Returns (attn_metadata or None in the profile run, the layer, its KV cache,
    its slot mapping or None).
    """
    forward_context = get_forward_context()
    if layer_name not in forward_context.no_compile_layers:
        raise KeyError(f"No layer named {layer_name!r} is registered in the static forward context.")
    metadata = forward_context.attn_metadata  # its type is checked when the context is made
    if isinstance(metadata, list):
        # One dict per micro-batch (dual-batch overlap) or per model (speculative decoding):
        # index 0 is the base model's, as in vllm/model_executor/layers/attention/attention.py:709-715.
        metadata = metadata[0]
    if metadata is not None and layer_name not in metadata:
        raise KeyError(
            f"The forward context has no attention metadata for layer {layer_name!r} "
            f"(it has {len(metadata)} entries); build_attn_metadata covers every layer of every attention group."
        )
    attn_metadata = metadata[layer_name] if metadata is not None else None
    layer: AttentionOpLayer = forward_context.no_compile_layers[layer_name]
    return attn_metadata, layer, layer.kv_cache, forward_context.slot_mapping.get(layer_name)


def kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Write this step's K/V of `layer_name` into its cache; return the dummy dependency.

    A None slot mapping (no cache bound yet, e.g. the profile run) writes nothing.
    """
    _, layer, kv_cache, slot_mapping = get_attention_context(layer_name)
    if slot_mapping is not None:
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    return torch.empty(0, device=key.device, dtype=key.dtype)


def attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Attention of `layer_name` over its paged cache, written into `output`."""
    attn_metadata, layer, kv_cache, _ = get_attention_context(layer_name)
    if attn_metadata is None and layer.calculate_kv_scales:  # the profile run sets fp8 scales, if asked to
        layer.calc_kv_scales(key, value)
    layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)


# The same two functions behind opaque ops (pagedkv/library.py; the direct-call path calls them
# as they are). The fake implementations tell torch.compile the output shapes without running anything.


def _unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    attention_with_output(query, key, value, output, layer_name)


def _kv_cache_update_fake(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty(0, device=key.device, dtype=key.dtype)


def _attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    return None


def register_attention_ops(kv_cache_update_name: str, attention_name: str) -> None:
    """Define the two ops a kind of attention layer calls, its cache write and its attention, under its names."""
    register_op(kv_cache_update_name, kv_cache_update, _kv_cache_update_fake, mutates_args=())
    register_op(attention_name, _unified_attention_with_output, _attention_fake, mutates_args=("output",))


register_attention_ops("unified_kv_cache_update", "unified_attention_with_output")
