"""Attention groups, the KV cache they read, and the per-step metadata built once per group.

    KV cache group 0 (sliding window)          KV cache group 1 (full attention)
      attention group (TORCH_REF, spec, 4 heads)   attention group (TORCH_REF, spec', 4 heads)
        layers 0, 2 -> one builder                   layers 1, 3 -> one builder
        each step: one CommonAttentionMetadata per KV cache group,
                   one builder.build(...) per attention group,
                   the same metadata object under every layer name of the group

A kernel may read smaller pages than the KV cache manager's blocks. Then every layer of the
KV cache group sees its cache cut into kernel blocks, and its builder sees the block table
rewritten into kernel block ids (`to_kernel_block_table`); block_size 64, kernel block 16:

    manager blocks (the KV cache manager's)  |      0      |      1      |      2      |
    kernel blocks  (the layer's cache view)  |  0  1  2  3 |  4  5  6  7 |  8  9 10 11 |  same bytes
    block table row [2, 1]  ->  [8, 9, 10, 11, 4, 5, 6, 7]
    slot 2*64 + 20 = 148 = (8 + 1)*16 + 4: the slot mapping is the same in both views
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from pagedkv.attention.layer import Attention
from pagedkv.config import CacheConfig, EngineConfig
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from pagedkv.worker.memory import check_fits


@dataclass
class AttentionGroup:
    """Layers of one KV cache group with the same backend, KV cache spec and query-head count."""

    backend: type[AttentionBackend]
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    """The KV cache group's spec, in the KV cache manager's blocks."""
    kv_cache_group_id: int
    num_heads: int
    kernel_block_size: int
    """Block size the kernel reads, one for the whole KV cache group; the manager's block size
    is a multiple of it."""
    metadata_builder: AttentionMetadataBuilder[Any] | None = None
    kernel_block_table: torch.Tensor | None = None
    """Where the kernel-block rewrite of the block table is written when kernel blocks are
    smaller (allocated once by the runner): a CUDA graph keeps reading the same memory."""

    @property
    def kernel_kv_cache_spec(self) -> KVCacheSpec:
        """The spec the builder sees: the same cache, counted in kernel blocks."""
        return replace(self.kv_cache_spec, block_size=self.kernel_block_size)

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
        kernel_table = to_kernel_block_table(common.block_table_tensor, k, self.kernel_block_table)
        return CommonAttentionMetadata(**{**common.__dict__, "block_table_tensor": kernel_table})


def to_kernel_block_table(
    block_table: torch.Tensor, kernel_blocks_per_block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rewrite a block table of manager blocks into one of `k` times smaller kernel blocks.

    Manager block b of size B is kernel blocks b*k, ..., b*k + k-1 of size B/k (the same
    memory), so row [7, 2] with k = 2 becomes [14, 15, 4, 5]. Slots keep their numbers:
    b*B + o == (b*k + o // (B/k)) * (B/k) + o % (B/k).

    With `out` (at least as many rows, k times the columns), the rows are written into its
    first rows and a view of them is returned.
    """
    k = kernel_blocks_per_block
    offsets = torch.arange(k, device=block_table.device, dtype=block_table.dtype)
    rows, width = block_table.shape
    if out is None:
        return (block_table[:, :, None] * k + offsets).flatten(1)
    torch.add(block_table[:, :, None] * k, offsets, out=out[:rows].view(rows, width, k))
    return out[:rows]


def kernel_reads_block_size(backend: type[AttentionBackend], size: int) -> bool:
    """Whether the backend's kernel reads pages of exactly `size` tokens."""
    return any(
        size % s.base == 0 if isinstance(s, MultipleOf) else size == s
        for s in backend.get_supported_kernel_block_sizes()
    )


def select_kernel_block_size(backends: Sequence[type[AttentionBackend]], block_size: int) -> int:
    """The largest page size that divides the manager's `block_size` and every backend reads.

    The manager's own size when it is readable (an exact match, or a `MultipleOf` it is a
    multiple of), else the largest exact kernel size dividing it. All attention groups of one
    KV cache group share its cache views (KV-sharing layers included), so they share one size.
    """
    for size in range(block_size, 0, -1):
        if block_size % size == 0 and all(kernel_reads_block_size(b, size) for b in backends):
            return size
    declared = "; ".join(f"{b.get_name()} reads {b.get_supported_kernel_block_sizes()}" for b in backends)
    raise ValueError(
        f"No kernel block size divides block_size={block_size} and is read by every backend of the "
        f"KV cache group ({declared}); choose a block_size that is a multiple of a size they all read."
    )


def max_blocks_per_request(config: EngineConfig) -> int:
    """How many KV cache blocks a request of `max_model_len` tokens needs: the width of a block table
    row (vLLM's max_num_blocks_per_req, vllm/v1/worker/gpu_model_runner.py). Integer ceil, no floats."""
    return -(-config.model_config.max_model_len // config.cache_config.block_size)


def check_batch_invariance(layers: dict[str, Attention]) -> None:
    """The batch-invariant mode refuses, at start-up, a layer whose backend cannot keep a query row's
    computation independent of its batch (vLLM raises the same under VLLM_BATCH_INVARIANT=1)."""
    refused = [layer.attn_backend for layer in layers.values() if not layer.attn_backend.supports_batch_invariance()]
    if refused:
        backend = refused[0].get_name()
        names = [name for name, layer in layers.items() if layer.attn_backend.get_name() == backend]
        raise RuntimeError(
            f"batch_invariant=True: attention backend {backend} does not support batch invariance (its kernels "
            f"choose splits or tiles from the batch), and it serves {len(names)} layer(s), e.g. {names[0]!r}. "
            "Use attention_backend='TRITON_ATTN' or 'TORCH_REF', or batch_invariant=False."
        )


def init_attn_groups(
    layers: dict[str, Attention],
    kv_cache_config: KVCacheConfig,
    config: EngineConfig,
    device: torch.device,
) -> list[list[AttentionGroup]]:
    """Per KV cache group, its attention groups, each with one metadata builder.

    The kernel block size is chosen here, once per KV cache group: `init_kv_cache` shapes the
    cache views with it, so this runs before the cache is allocated. Where kernel blocks are
    smaller, the group gets its persistent kernel block table here too.
    """
    max_reqs = config.scheduler_config.max_num_seqs
    max_blocks = max_blocks_per_request(config)
    all_groups: list[list[AttentionGroup]] = []
    for group_id, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        members = group_spec.layer_names + [
            name for name, layer in layers.items() if layer.kv_sharing_target_layer_name in group_spec.layer_names
        ]
        spec = group_spec.kv_cache_spec
        kernel_block_size = select_kernel_block_size(
            list(dict.fromkeys(layers[n].attn_backend for n in members)), spec.block_size
        )
        groups: dict[tuple[str, int], AttentionGroup] = {}
        for name in members:
            layer = layers[name]
            key = (layer.attn_backend.full_cls_name(), layer.num_heads)
            if key not in groups:
                groups[key] = AttentionGroup(layer.attn_backend, [], spec, group_id, layer.num_heads, kernel_block_size)
            groups[key].layer_names.append(name)
        for group in groups.values():
            group.metadata_builder = group.backend.get_builder_cls()(
                group.kernel_kv_cache_spec, group.layer_names, config, device
            )
            k = spec.block_size // kernel_block_size
            if k > 1:
                group.kernel_block_table = torch.zeros(max_reqs, max_blocks * k, dtype=torch.int32, device=device)
        all_groups.append(list(groups.values()))
    return all_groups


def init_kv_cache(
    layers: dict[str, Attention],
    kv_cache_config: KVCacheConfig,
    attn_groups: list[list[AttentionGroup]],
    cache_config: CacheConfig,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Allocate the KV cache and bind it: one zeroed buffer per KV cache group, a view per layer in
    the group's kernel blocks (vLLM: initialize_kv_cache_tensors in vllm/v1/worker/gpu_model_runner.py,
    init_kv_cache in vllm/v1/worker/gpu/attn_utils.py). Layer name -> its view (KV-sharing layers
    have none of their own: they are bound to their target's)."""
    kv_caches: dict[str, torch.Tensor] = {}
    for group_spec, groups in zip(kv_cache_config.kv_cache_groups, attn_groups):
        kv_caches.update(
            _allocate_kv_cache_group(
                layers, group_spec, groups[0].kernel_block_size, kv_cache_config.num_blocks, cache_config, device
            )
        )
    bind_kv_cache(kv_caches, layers)
    return kv_caches


def _allocate_kv_cache_group(
    layers: dict[str, Attention],
    group_spec: KVCacheGroupSpec,
    kernel_block_size: int,
    num_blocks: int,
    cache_config: CacheConfig,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One zeroed buffer for the group; each layer's slice viewed as pages of the kernel's size.

    The manager's `num_blocks` blocks of B tokens are `num_blocks * k` kernel blocks of B/k
    tokens (k = B / kernel_block_size): the same bytes, cut finer. Manager block b is kernel
    blocks b*k ... b*k + k-1, which is how the attention groups rewrite the block table.
    """
    spec = group_spec.kv_cache_spec
    k = spec.block_size // kernel_block_size
    shapes = [
        layers[name].attn_backend.get_kv_cache_shape(
            num_blocks * k, kernel_block_size, spec.num_kv_heads, spec.head_size
        )
        for name in group_spec.layer_names
    ]
    per_layer = math.prod(shapes[0])
    check_fits(
        f"The KV cache ({num_blocks} blocks of {spec.block_size} tokens for {len(shapes)} layers)",
        per_layer * len(shapes) * spec.dtype.itemsize,
        device,
        f"it was sized by num_kv_blocks={cache_config.num_kv_blocks}, kv_cache_memory={cache_config.kv_cache_memory}; "
        "lower them, or leave both None to size it from free memory.",
    )
    buffer = torch.zeros(per_layer * len(shapes), dtype=spec.dtype, device=device)
    return {
        name: buffer[i * per_layer : (i + 1) * per_layer].view(shape)
        for i, (name, shape) in enumerate(zip(group_spec.layer_names, shapes))
    }


def bind_kv_cache(kv_caches: dict[str, torch.Tensor], layers: dict[str, Attention]) -> None:
    """Give every attention layer its cache view, by name; a KV-sharing layer gets its target's
    (vLLM: bind_kv_cache in vllm/v1/worker/utils.py)."""
    for name, layer in layers.items():
        target = layer.kv_sharing_target_layer_name
        layer.bind_kv_cache(kv_caches[target if target is not None else name])


def layer_kv_groups(attn_groups: list[list[AttentionGroup]]) -> dict[str, int]:
    """Layer name -> its KV cache group: whose slot mapping the layer reads each step."""
    return {name: group.kv_cache_group_id for groups in attn_groups for group in groups for name in group.layer_names}


def kv_group_causal(attn_groups: list[list[AttentionGroup]], layers: dict[str, Attention]) -> list[bool]:
    """Per KV cache group, whether its attention is causal: decoder self-attention is, encoder-only
    (bidirectional) attention is not (`CommonAttentionMetadata.causal`, as in vllm/v1/attention/backends/
    utils.py). A group's layers share one `CommonAttentionMetadata`, so they must agree (vLLM gives
    encoder-only layers a KV cache group of their own)."""
    causal: list[bool] = []
    for groups in attn_groups:
        types = {layers[name].attn_type for group in groups for name in group.layer_names}
        if len(types) > 1:
            raise ValueError(
                f"KV cache group {groups[0].kv_cache_group_id} mixes attention types "
                f"{sorted(t.value for t in types)}; its layers share one metadata."
            )
        causal.append(types != {AttentionType.ENCODER_ONLY})
    return causal


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


def min_cudagraph_support(attn_groups: list[list[AttentionGroup]]) -> tuple[AttentionCGSupport, str]:
    """The weakest CUDA graph support among all builders (it limits the whole model) and the
    name of the backend that declares it; (ALWAYS, "no attention") without attention groups.

    Read from the builder object: a builder may declare less than its class does for the
    kernel it found (FLASH_ATTN with flash-attn 2).
    """
    supports = [
        (g.metadata_builder.cudagraph_support, g.backend.get_name())
        for groups in attn_groups
        for g in groups
        if g.metadata_builder is not None
    ]
    return min(supports, key=lambda s: s[0].value, default=(AttentionCGSupport.ALWAYS, "no attention"))
