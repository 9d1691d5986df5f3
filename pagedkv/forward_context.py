"""The forward context: per-step data that layers look up by their name.

A model file calls `self.attn(q, k, v)` and nothing else. Everything that changes every
step (attention metadata, where to write new K/V) is put in a module-level
`ForwardContext` by the runner for the duration of one forward pass:

    static_forward_context   {"model.layers.0.self_attn.attn": <Attention>, ...}   (start-up)
    ForwardContext           .attn_metadata[name], .slot_mapping[name]            (each step)

The custom attention op receives only tensors and the layer *name*, and resolves the
rest here -- like an actor taking tonight's props from the spot labelled with their name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pagedkv.config import CUDAGraphMode, EngineConfig

T = TypeVar("T")


def get_layers_from_config(config: EngineConfig, layer_type: type[T]) -> dict[str, T]:
    """The layers of the static forward context that are `layer_type`s, by name, in registration order.

    Attention layers and FusedMoE layers both register there (vLLM's get_layers_from_vllm_config,
    vllm/config/__init__.py): whoever wants one kind asks for it by type instead of assuming every
    entry is an attention layer.
    """
    registry = config.compilation_config.static_forward_context
    return {name: layer for name, layer in registry.items() if isinstance(layer, layer_type)}


def register_layer(config: EngineConfig, prefix: str, layer: Any) -> None:
    """Put `layer` in the static forward context under its unique name `prefix`.

    The one way Attention and FusedMoE layers register (vLLM does it in each layer's __init__:
    vllm/attention/layer.py, vllm/model_executor/layers/fused_moe/layer.py). Layers call it last in
    __init__, once built, so that a constructor that fails leaves no half-made layer registered.
    """
    static_forward_context = config.compilation_config.static_forward_context
    if prefix in static_forward_context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    static_forward_context[prefix] = layer


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape of a batch, as far as CUDA graphs care: the key a graph is captured under."""

    num_tokens: int
    uniform_decode: bool = False
    """Every request has exactly one query token."""


AttnMetadata = dict[str, Any] | list[dict[str, Any]] | None
"""Layer name -> this step's attention metadata; or one such dict per micro-batch (dual-batch
overlap) or per model (speculative decoding), of which the ops read index 0; None in the profile run."""


@dataclass
class ForwardContext:
    """What one forward pass can look up by layer name."""

    no_compile_layers: dict[str, Any]
    """`compilation_config.static_forward_context` itself (not a copy): name -> layer."""
    attn_metadata: AttnMetadata
    """Layer name -> this step's attention metadata, a list of such dicts, or None (`AttnMetadata`)."""
    slot_mapping: dict[str, torch.Tensor]
    """Layer name -> flat cache slot of every new token (-1 for padding)."""
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None

    def __post_init__(self) -> None:
        # Refused here, where the runner builds the context, rather than as an AttributeError deep
        # inside some layer's op (vLLM asserts the slot mapping's type in get_attention_context,
        # vllm/model_executor/layers/attention/attention.py).
        if not isinstance(self.slot_mapping, dict):
            raise TypeError(
                f"Expected slot_mapping to be a dict (layer name -> slots), got {type(self.slot_mapping).__name__}."
            )
        metadata = self.attn_metadata
        expected = (
            "Expected attn_metadata to be a dict (layer name -> metadata), a non-empty list of such dicts or None"
        )
        if isinstance(metadata, list):
            if not metadata:
                raise TypeError(f"{expected}, got an empty list.")
            others = sorted({type(entry).__name__ for entry in metadata if not isinstance(entry, dict)})
            if others:
                raise TypeError(f"{expected}, got a list holding {', '.join(others)}.")
        elif metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"{expected}, got {type(metadata).__name__}.")


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress."""
    if _forward_context is None:
        raise RuntimeError("Forward context is not set. Please use `set_forward_context` to set the forward context.")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttnMetadata,
    config: EngineConfig,
    *,
    slot_mapping: dict[str, torch.Tensor] | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[ForwardContext]:
    """Install a `ForwardContext` for the `with` block; restore the previous one on exit.

    A `slot_mapping` or `attn_metadata` of the wrong kind is refused here with a TypeError.
    """
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping if slot_mapping is not None else {},
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
    )
    try:
        yield _forward_context
    finally:
        _forward_context = previous
