"""TRITON_ATTN: the paged-attention Triton kernels of `pagedkv.kernels` as a backend.

    builder (one per attention group)   allocates the split-KV scratch once; each step it picks
                                        the kernel's tiles and splits (host-side, once for all
                                        layers of the group) and repackages the metadata
    impl (one per layer)                do_kv_cache_update -> reshape_and_cache (scatter by slot)
                                        forward            -> unified_attention (one launch,
                                                              + a merge launch for split decode)

Nothing per step reads device memory on the host or allocates, so any batch, mixed prefill and
decode included, can be captured in a full CUDA graph (AttentionCGSupport.ALWAYS). The launch
shape depends on two host integers, `max_query_len` and `max_seq_len`; a graph stays correct
for every batch whose true values are at most those seen at capture, so the capture metadata
uses upper bounds (see `build_for_cudagraph_capture`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypedDict

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.config import EngineConfig
from pagedkv.kernels import HAS_TRITON, SplitKVWorkspace, reshape_and_cache, unified_attention
from pagedkv.kernels.attention_config import KernelConfig, batch_invariant_config, choose_config
from pagedkv.kernels.common import check_head_size, interpreter_problem, next_power_of_2
from pagedkv.kv_cache.fp8 import is_fp8
from pagedkv.kv_cache.spec import KVCacheSpec

SPLIT_ROWS_PER_SEQ = 32
"""Split-KV scratch rows per request slot. Decode splits only when there are few requests, so
this rarely binds; where it does, the launcher picks fewer splits."""


@dataclass
class TritonAttentionMetadata:
    """What `unified_attention` needs, built once per attention group and step."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    workspace: SplitKVWorkspace
    config: KernelConfig
    """Tiles, warps and split count, chosen once per step for all layers of the group."""
    causal: bool = True


class GroupShape(TypedDict):
    """The launch-config arguments fixed for an attention group: the same every step."""

    device: torch.device
    head_pad: int
    dtype: torch.dtype
    num_queries_per_kv: int


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Holds the split-KV scratch; per step it picks the launch config and repackages tensors."""

    cudagraph_support = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        config: EngineConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.num_q_heads = config.compilation_config.static_forward_context[layer_names[0]].num_heads
        rows = config.scheduler_config.max_num_seqs * SPLIT_ROWS_PER_SEQ
        # All layers of the group run one after another, so they can share one scratch buffer.
        self.workspace = SplitKVWorkspace(rows, self.num_q_heads, kv_cache_spec.head_size, device)
        # The group's fixed facts, once: the tiles depend on them and, per step, on the batch.
        self.shape = GroupShape(
            device=device,
            head_pad=next_power_of_2(kv_cache_spec.head_size),
            dtype=config.model_config.dtype,  # what the dots run in (an fp8 cache is cast to it)
            num_queries_per_kv=self.num_q_heads // kv_cache_spec.num_kv_heads,
        )
        self.batch_invariant = config.model_config.batch_invariant
        """The batch-invariant mode: `batch_invariant_config`'s tiles (no split-KV), not `choose_config`'s."""

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        return self._metadata(cm, cm.max_query_len, cm.max_seq_len)

    def _metadata(self, cm: CommonAttentionMetadata, max_query_len: int, max_seq_len: int) -> TritonAttentionMetadata:
        spec = self.kv_cache_spec
        if self.batch_invariant:
            config = batch_invariant_config(**self.shape, max_query_len=max_query_len)
        else:
            config = choose_config(
                **self.shape,
                num_kv_heads=spec.num_kv_heads,
                num_reqs=cm.num_reqs,
                num_tokens=cm.num_actual_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                kv_bytes=spec.dtype.itemsize,
            )
        return TritonAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            workspace=self.workspace,
            config=config,
            causal=cm.causal,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Capture with upper bounds, so that the graph is right for every batch replayed in it
        (`cudagraph_capture_bounds`). max_seq_len only sizes the split-KV grid: the model's
        longest sequence keeps long decodes fast."""
        cm = common_attn_metadata
        return self._metadata(cm, *cudagraph_capture_bounds(cm, self.config.model_config.max_model_len))


def cudagraph_capture_bounds(cm: CommonAttentionMetadata, max_model_len: int) -> tuple[int, int]:
    """(max_query_len, max_seq_len) to capture a batch with: bounds that hold for every batch
    replayed in its graph, since a graph keeps the host-side integers it was captured with.

    A uniform decode capture keeps its query length (1, or 1 + k with speculative decoding: it is
    replayed for such batches only); any other batch of N tokens may hold one request of up to N
    tokens. Any sequence may be as long as the model allows.
    """
    uniform = cm.uniform_decode or cm.max_query_len == 1
    max_query_len = cm.max_query_len if uniform else max(cm.max_query_len, cm.num_actual_tokens)
    return max_query_len, max_model_len


class TritonCacheWriter:
    """The K/V scatter of an impl whose cache is `(2, num_blocks, block_size, heads, head_size)`:
    `reshape_and_cache` into the K and V halves. TRITON_ATTN and FLASH_ATTN share it."""

    _cache_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(kv_cache, its K view, its V view): made once, since each view costs host time every call."""

    kv_scales: Callable[[AttentionLayer], dict[str, torch.Tensor]]
    """`AttentionImpl.kv_scales`, which every class mixing this in also derives from (a
    declaration for the type checker: no attribute is made here, so the MRO finds the method)."""

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._cache_views
        if views is None or views[0] is not kv_cache:
            k, v = kv_cache.unbind(0)
            views = self._cache_views = (kv_cache, k, v)
        return views[1], views[2]

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reshape_and_cache(key, value, *self._kv_views(kv_cache), slot_mapping, **self.kv_scales(layer))


class TritonAttentionImpl(TritonCacheWriter, AttentionImpl[TritonAttentionMetadata]):
    """Scatter with `reshape_and_cache`, attend with `unified_attention`."""

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profile run: shapes only
            return output.zero_()
        if not attn_metadata.causal:
            raise NotImplementedError("TRITON_ATTN implements causal (decoder) attention only")
        k_cache, v_cache = self._kv_views(kv_cache)
        # Rows past the batch's last token (CUDA graph padding) are left as they are.
        return unified_attention(
            query,
            k_cache,
            v_cache,
            output,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            block_table=attn_metadata.block_table,
            softmax_scale=self.scale,
            sliding_window=self.sliding_window,
            workspace=attn_metadata.workspace,
            config=attn_metadata.config,
            **self.kv_scales(layer),
        )


class TritonBackendRules:
    """What a backend of Triton kernels refuses whatever its kernel: no triton, a KV cache dtype
    other than the model's, the CPU without Triton's interpreter. TRITON_ATTN and TRITON_MLA
    share it; `kernel_reasons` adds a kernel's own limits."""

    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]]
    """`AttentionBackend`'s, which every backend mixing this in also derives from (a declaration
    only: the MRO finds the backend's own tuple)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if HAS_TRITON else "triton is not installed"

    @classmethod
    def kernel_reasons(cls, head_size: int) -> list[str]:
        return []

    @classmethod
    def extra_reasons(
        cls, *, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype, device_type: str
    ) -> list[str]:
        reasons = cls.kernel_reasons(head_size)
        if kv_cache_dtype != dtype and kv_cache_dtype in cls.supported_kv_cache_dtypes and not is_fp8(kv_cache_dtype):
            reasons.append(f"KV cache dtype {kv_cache_dtype} must equal the model dtype {dtype} (or be fp8)")
        problem = interpreter_problem() if device_type == "cpu" and HAS_TRITON else None
        if problem:
            reasons.append(problem)
        return reasons


class TritonAttentionBackend(TritonBackendRules, AttentionBackend):
    """Triton paged attention: CUDA, or the CPU under Triton's interpreter (slow; for learning)."""

    forward_includes_kv_cache_update = False
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes = (*supported_dtypes, torch.float8_e4m3fn)  # fp8: dequantized on load
    supported_devices = ("cuda", "cpu")

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def kernel_reasons(cls, head_size: int) -> list[str]:
        try:
            check_head_size(head_size)
        except ValueError as exc:
            return [str(exc)]
        return []
