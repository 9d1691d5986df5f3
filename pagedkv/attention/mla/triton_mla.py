"""TRITON_MLA: decodes by the Triton paged MLA kernel (`pagedkv.kernels.mla_decode`), with split-KV.

    builder (one per attention group)  allocates the split-KV scratch once; per step it splits
                                       the batch (decodes first) and picks the decode kernel's
                                       split count on the host, once for every layer
    impl (one per layer)               do_kv_cache_update -> concat_and_cache_mla
                                       forward_mqa        -> mla_decode_attention (+ merge)
                                       forward_mha        -> the shared torch prefill path

A pure-decode step does nothing on the host that reads the device or allocates per layer, so it
can be captured as a full CUDA graph (UNIFORM_SINGLE_TOKEN_DECODE); steps with prefills run
forward_mha, whose loop over requests reads host-side lengths, eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedkv.attention.backend import AttentionCGSupport, CommonAttentionMetadata, MultipleOf
from pagedkv.attention.backends.triton_attn import TritonBackendRules
from pagedkv.attention.mla.common import MLACommonBackend, MLACommonImpl, MLACommonMetadataBuilder, MLADecodeMetadata
from pagedkv.config import EngineConfig
from pagedkv.kernels import HAS_TRITON
from pagedkv.kv_cache.spec import KVCacheSpec

if HAS_TRITON:
    from pagedkv.kernels.mla_decode import MLADecodeWorkspace, default_num_kv_splits, mla_decode_attention


@dataclass
class TritonMLADecodeMetadata(MLADecodeMetadata):
    """The decode part, plus the kernel's scratch and split count."""

    workspace: MLADecodeWorkspace | None = None
    num_kv_splits: int = 1


class TritonMLAMetadataBuilder(MLACommonMetadataBuilder):
    """Holds the split-KV scratch; picks the split count once per step for all layers."""

    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], config: EngineConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        layer = config.compilation_config.static_forward_context[layer_names[0]]
        self.num_heads, self.kv_lora_rank = layer.num_heads, layer.mla_dims.kv_lora_rank
        # All layers of the group run one after another, so they share one scratch buffer.
        self.workspace = MLADecodeWorkspace(config.scheduler_config.max_num_seqs, self.num_heads,
                                            self.kv_lora_rank, device)

    def build_decode(
        self, cm: CommonAttentionMetadata, num_decodes: int, seq_lens_cpu: list[int], max_seq_len: int
    ) -> MLADecodeMetadata:
        common = super().build_decode(cm, num_decodes, seq_lens_cpu, max_seq_len)
        splits = default_num_kv_splits(num_decodes, self.num_heads, max_seq_len, self.kv_cache_spec.block_size,
                                       self.kv_cache_spec.dtype, self.device)
        return TritonMLADecodeMetadata(**common.__dict__, workspace=self.workspace,
                                       num_kv_splits=min(splits, self.workspace.rows // num_decodes))


class TritonMLAImpl(MLACommonImpl[TritonMLADecodeMetadata]):
    """forward_mqa by `mla_decode_attention`; the rest from MLACommonImpl."""

    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor, decode: TritonMLADecodeMetadata) -> torch.Tensor:
        out = torch.empty(*q.shape[:2], self.mla_dims.kv_lora_rank, dtype=q.dtype, device=q.device)
        return mla_decode_attention(
            q, kv_cache, decode.block_table, decode.seq_lens, self.scale, self.mla_dims.kv_lora_rank, out,
            workspace=decode.workspace, num_kv_splits=decode.num_kv_splits,
        )


class TritonMLABackend(TritonBackendRules, MLACommonBackend):
    """Triton MLA decode: CUDA, or the CPU under Triton's interpreter (slow; for learning)."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes = supported_dtypes
    supported_devices = ("cuda", "cpu")

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_impl_cls() -> type[TritonMLAImpl]:
        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return TritonMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        """Pages of a power-of-two size (the kernel walks a page with a power-of-two tile)."""
        return [2**i for i in range(9)]
