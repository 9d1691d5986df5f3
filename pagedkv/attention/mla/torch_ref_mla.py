"""TORCH_REF_MLA: MLA in plain torch, one request at a time: the oracle for TRITON_MLA.

forward_mqa reads each decode's latent rows through its block table, like a paged kernel:

    rows  = cache[block_table[i]] flattened, first seq_len of them      [seq_len, kv_lora_rank + rope]
    score = q . rows * scale   (every head against the same rows: one shared "KV head")
    out   = softmax(score) @ rows[:, :kv_lora_rank]                       [heads, kv_lora_rank]
"""

from __future__ import annotations

import torch

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.attention.mla.common import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadataBuilder,
    MLADecodeMetadata,
    gather_latents,
)


class TorchRefMLAMetadataBuilder(MLACommonMetadataBuilder):
    cudagraph_support = AttentionCGSupport.NEVER  # loops over host-side lengths


class TorchRefMLAImpl(MLACommonImpl[MLADecodeMetadata]):
    """forward_mqa as a float32 loop over the decodes."""

    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor, decode: MLADecodeMetadata) -> torch.Tensor:
        out = torch.empty(*q.shape[:2], self.mla_dims.kv_lora_rank, dtype=torch.float32, device=q.device)
        for i, seq_len in enumerate(decode.seq_lens_cpu):
            rows = gather_latents(kv_cache, decode.block_table[i], 0, seq_len).float()
            probs = (q[i].float() @ rows.T * self.scale).softmax(dim=-1)  # [heads, seq_len]
            out[i] = probs @ rows[:, : self.mla_dims.kv_lora_rank]
        return out


class TorchRefMLABackend(MLACommonBackend):
    """Plain torch MLA on any device and dtype; any latent size and block size."""

    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    supported_kv_cache_dtypes = supported_dtypes
    supported_devices = ("cpu", "cuda")

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF_MLA"

    @staticmethod
    def get_impl_cls() -> type[TorchRefMLAImpl]:
        return TorchRefMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchRefMLAMetadataBuilder]:
        return TorchRefMLAMetadataBuilder
