"""Attention groups, and the per-step metadata built once per group.

    KV cache group 0 (full attention)          KV cache group 1 (sliding window)
      attention group (TORCH_REF, spec, 4 heads)   attention group (TORCH_REF, spec', 4 heads)
        layers 1, 3 -> one builder                   layers 0, 2 -> one builder
        each step: one CommonAttentionMetadata per KV cache group,
                   one builder.build(...) per attention group,
                   the same metadata object under every layer name of the group
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from pagedkv.attention.layer import Attention
from pagedkv.config import EngineConfig
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheSpec


@dataclass
class AttentionGroup:
    """Layers of one KV cache group with the same backend, KV cache spec and query-head count."""

    backend: type[AttentionBackend]
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int
    num_heads: int
    metadata_builder: AttentionMetadataBuilder[Any] | None = None
    kernel_block_size: int = 0
    """Block size the kernel reads; the KV cache manager's block size is a multiple of it."""

    def build_metadata(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> Any:
        assert self.metadata_builder is not None
        common = self._to_kernel_blocks(common)
        if for_cudagraph_capture:
            return self.metadata_builder.build_for_cudagraph_capture(common)
        return self.metadata_builder.build(common)

    def _to_kernel_blocks(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """The step's metadata with the block table in kernel-sized blocks, when those are smaller."""
        k = self.kv_cache_spec.block_size // self.kernel_block_size
        if k == 1:
            return common
        kernel_table = to_kernel_block_table(common.block_table_tensor, k)
        return CommonAttentionMetadata(**{**common.__dict__, "block_table_tensor": kernel_table})


def to_kernel_block_table(block_table: torch.Tensor, kernel_blocks_per_block: int) -> torch.Tensor:
    """Rewrite a block table of manager blocks into one of `k` times smaller kernel blocks.

    Manager block b of size B is kernel blocks b*k, ..., b*k + k-1 of size B/k (the same
    memory), so row [7, 2] with k = 2 becomes [14, 15, 4, 5]. Slots keep their numbers:
    b*B + o == (b*k + o // (B/k)) * (B/k) + o % (B/k).
    """
    k = kernel_blocks_per_block
    offsets = torch.arange(k, device=block_table.device, dtype=block_table.dtype)
    return (block_table[:, :, None] * k + offsets).flatten(1)


def select_kernel_block_size(backend: type[AttentionBackend], block_size: int) -> int:
    """The manager's block size if the kernel reads it, else the largest kernel size dividing it."""
    sizes = backend.get_supported_kernel_block_sizes()
    if any(isinstance(s, MultipleOf) and block_size % s.base == 0 for s in sizes) or block_size in sizes:
        return block_size
    fitting = [s for s in sizes if isinstance(s, int) and block_size % s == 0]
    if not fitting:
        raise ValueError(
            f"Backend {backend.get_name()} cannot read blocks of {block_size} tokens; "
            f"its kernel block sizes are {sizes}."
        )
    return max(fitting)


def init_attn_groups(
    layers: dict[str, Attention],
    kv_cache_config: KVCacheConfig,
    config: EngineConfig,
    device: torch.device,
) -> list[list[AttentionGroup]]:
    """Per KV cache group, its attention groups, each with one metadata builder."""
    all_groups: list[list[AttentionGroup]] = []
    for group_id, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        groups: dict[tuple[str, KVCacheSpec, int], AttentionGroup] = {}
        members = group_spec.layer_names + [
            name for name, layer in layers.items()
            if layer.kv_sharing_target_layer_name in group_spec.layer_names
        ]
        for name in members:
            layer = layers[name]
            key = (layer.attn_backend.full_cls_name(), group_spec.kv_cache_spec, layer.num_heads)
            if key not in groups:
                groups[key] = AttentionGroup(
                    layer.attn_backend, [], group_spec.kv_cache_spec, group_id, layer.num_heads
                )
            groups[key].layer_names.append(name)
        for group in groups.values():
            group.kernel_block_size = select_kernel_block_size(group.backend, group.kv_cache_spec.block_size)
            group.metadata_builder = group.backend.get_builder_cls()(
                group.kv_cache_spec, group.layer_names, config, device
            )
        all_groups.append(list(groups.values()))
    return all_groups


def build_attn_metadata(
    attn_groups: list[list[AttentionGroup]],
    common_by_kv_group: list[CommonAttentionMetadata],
    for_cudagraph_capture: bool = False,
) -> dict[str, Any]:
    """Layer name -> metadata, one `build` per attention group, shared by its layers."""
    attn_metadata: dict[str, Any] = {}
    for groups, common in zip(attn_groups, common_by_kv_group):
        for group in groups:
            metadata = group.build_metadata(common, for_cudagraph_capture)
            for name in group.layer_names:
                attn_metadata[name] = metadata
    return attn_metadata


def min_cudagraph_support(attn_groups: list[list[AttentionGroup]]) -> AttentionCGSupport:
    """The weakest CUDA graph support among all builders: it limits the whole model."""
    supports = [type(g.metadata_builder).cudagraph_support for groups in attn_groups for g in groups]
    return min(supports, key=lambda s: s.value, default=AttentionCGSupport.ALWAYS)
