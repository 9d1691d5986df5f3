"""The two attention custom ops, registered once in the `pagedkv` torch library.

For torch.compile each call is one opaque node whose inputs are plain tensors and a
layer name; the op looks up everything else (layer, KV cache, metadata, slot mapping)
in the forward context. So the traced graph does not depend on Python objects that
change every step, and the compiler can split the graph at these ops.

    k, v ──> unified_kv_cache_update(k, v, name) ──> dummy (empty tensor)
                                                        │  data dependency: the
    q, k, v, out, dummy ──> unified_attention_with_output   write happens first
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.attention.layer import get_attention_context


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
    layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)


# The same two functions behind opaque ops (the direct-call path calls them as they are).
#
# They are registered straight into a `torch.library.Library`, not with the
# `@torch.library.custom_op` decorator: the decorator's Python wrapper costs ~15-20 us per
# call, twice per layer and step, while a plain registration goes through the C++ dispatcher
# in a few us (vLLM's `direct_register_custom_op` does the same). The fake implementations
# tell torch.compile the output shapes without running anything.

_LIBRARY = torch.library.Library("pagedkv", "FRAGMENT")


def register_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
    """Define `pagedkv::<name>` with the schema read off `impl`'s type hints."""
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=mutates_args))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedkv::{name}", fake, lib=_LIBRARY)


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


register_op("unified_kv_cache_update", kv_cache_update, _kv_cache_update_fake, mutates_args=())
register_op(
    "unified_attention_with_output", _unified_attention_with_output, _attention_fake, mutates_args=("output",)
)
