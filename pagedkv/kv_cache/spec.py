"""KV cache specs: what one layer needs per block, and how layers group.

Layers whose specs are equal share one KV cache *group*: one backing buffer, one block
table per request, one slot mapping per step. A model with sliding-window layers and
full-attention layers has two groups, because a sliding-window layer can give back the
blocks that fell out of its window while a full-attention layer keeps them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer cache geometry; equal specs -> same group."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V, `block_size` tokens each."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: keep every block."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Attend to the last `sliding_window` positions only: older blocks can be freed."""

    sliding_window: int = 0


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent row per token, no separate V, one "KV head".

        page of block_size rows:  [ c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim) ]   (head_size = both)

    Every query head's keys and values are recomputed from c_kv (or absorbed into the query),
    so a DeepSeek-V2-Lite layer stores 512 + 64 = 576 values per token, where the same layer
    with MHA would store 16 heads x (192 for K + 128 for V) = 5,120.
    """

    @property
    def page_size_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (and one backing buffer)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """The cache the runner allocates: `num_blocks` blocks in every group."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]

    @property
    def bytes_per_block(self) -> int:
        """One block in every layer of every group."""
        return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in self.kv_cache_groups)


def group_layers_by_spec(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group layer names by equal spec, keeping model order (first layer of each group)."""
    groups: dict[KVCacheSpec, KVCacheGroupSpec] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, KVCacheGroupSpec([], spec)).layer_names.append(name)
    return list(groups.values())


def get_kv_cache_config(
    specs: dict[str, KVCacheSpec],
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
) -> KVCacheConfig:
    """Size the cache from an explicit block count or from a memory budget in bytes."""
    groups = group_layers_by_spec(specs)
    config = KVCacheConfig(num_blocks=0, kv_cache_groups=groups)
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("Give num_blocks or memory_bytes to size the KV cache.")
        num_blocks = memory_bytes // config.bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"The KV cache would hold {num_blocks} blocks of {config.bytes_per_block} bytes (all layers; "
            f"block_size={groups[0].kv_cache_spec.block_size} tokens); at least 2 are needed (block 0 is the reserved "
            "null block). Give more memory, a larger num_kv_blocks or a smaller block_size."
        )
    config.num_blocks = num_blocks
    return config
