"""TORCH_REF: attention over the paged cache in plain torch, one request at a time.

Slow and obvious on purpose: it is the oracle the GPU backends are tested against. It
reads K/V only through the block table, exactly like a paged kernel:

    block_table[i] = [7, 2, 9]        block_size 4, seq_len 10
    keys of request i = cache[7][0:4] ++ cache[2][0:4] ++ cache[9][0:2]

An fp8 cache (pagedkv/kv_cache/fp8.py) is quantized on write (x / scale, saturated to +-448) and
dequantized on load (stored * scale), then attended to in the usual compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.kv_cache.fp8 import dequantize_fp8, quantize_fp8


@dataclass
class TorchRefMetadata:
    """Host-side lengths (the per-request loop reads them) plus the device tensors."""

    num_actual_tokens: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    batch_invariant: bool = False
    """Attend row by row over exactly each row's keys (`paged_attention_reference(per_row=True)`)."""


class TorchRefMetadataBuilder(AttentionMetadataBuilder[TorchRefMetadata]):
    """Copies lengths to Python lists once per step, for all layers of the group."""

    cudagraph_support = AttentionCGSupport.NEVER  # loops over host-side lengths

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> TorchRefMetadata:
        cm = common_attn_metadata
        return TorchRefMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc_cpu=cm.query_start_loc_cpu.tolist(),
            seq_lens_cpu=cm.seq_lens_cpu.tolist(),
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            batch_invariant=self.config is not None and self.config.model_config.batch_invariant,
        )


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    per_row: bool = False,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per request, K/V gathered through `block_table`.

    query/output [tokens, heads, head_size]; k_cache/v_cache [blocks, block_size, kv_heads, head_size].
    `per_row` computes each query token on its own over exactly the keys it sees: the shapes of its
    products and of its softmax then depend on its position alone, never on how many query tokens
    share its step (a chunk, a whole prompt, a decode), which the batch-invariant mode needs.
    `k_scale` / `v_scale` (an fp8 cache): K and V are read as stored * scale.
    """
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        # [seq_len, kv_heads, D] -> one K/V head repeated for each query head it serves
        k, v = k_cache[blocks].flatten(0, 1)[:seq_len], v_cache[blocks].flatten(0, 1)[:seq_len]
        if k_scale is not None and v_scale is not None:  # an fp8 cache: dequantize on load
            k, v = dequantize_fp8(k, k_scale, compute_dtype), dequantize_fp8(v, v_scale, compute_dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[start:end]
        if per_row:
            for j in range(query_len):
                pos = seq_len - query_len + j
                lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
                hi = pos + 1 if causal else seq_len
                row = torch.einsum("hd,khd->hk", q[j].to(compute_dtype), k[lo:hi].to(compute_dtype)) * scale
                out = torch.einsum("hk,khd->hd", row.softmax(dim=-1), v[lo:hi].to(compute_dtype))
                output[start + j] = out.to(output.dtype)
            continue
        scores = torch.einsum("qhd,khd->hqk", q.to(compute_dtype), k.to(compute_dtype)) * scale
        # The query tokens are the last query_len positions of the sequence.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= (q_pos - k_pos) < sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, v.to(compute_dtype)).to(output.dtype)
    return output


class TorchRefImpl(AttentionImpl[TorchRefMetadata]):
    """Scatter by slot, then `paged_attention_reference`."""

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchRefMetadata | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profile run: shapes only
            return output.zero_()
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = kv_cache.unbind(0)
        paged_attention_reference(
            query[:n],
            k_cache,
            v_cache,
            output[:n],
            attn_metadata.query_start_loc_cpu,
            attn_metadata.seq_lens_cpu,
            attn_metadata.block_table,
            self.scale,
            self.sliding_window,
            attn_metadata.causal,
            per_row=attn_metadata.batch_invariant,
            **self.kv_scales(layer),
        )
        output[n:].zero_()  # padding rows
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # slot = block * block_size + offset, so the cache viewed as [blocks * block_size, ...]
        # is indexed by slot directly. Slots of -1 (padding) are skipped.
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        num_kv_heads, head_size = kv_cache.shape[-2:]
        scales = self.kv_scales(layer)  # an fp8 cache's, else none
        for cache, new, name in zip(kv_cache.unbind(0), (key, value), ("k_scale", "v_scale")):
            new = new[: slot_mapping.shape[0]][valid]
            cache.view(-1, num_kv_heads, head_size)[slots] = (
                quantize_fp8(new, scales[name]) if scales else new.to(cache.dtype)
            )


class TorchRefBackend(AttentionBackend):
    """Plain torch on any device and dtype; any head size and block size."""

    forward_includes_kv_cache_update = False
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    supported_kv_cache_dtypes = (*supported_dtypes, torch.float8_e4m3fn)
    supported_devices = ("cpu", "cuda")

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF"

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[TorchRefImpl]:
        return TorchRefImpl

    @staticmethod
    def get_builder_cls() -> type[TorchRefMetadataBuilder]:
        return TorchRefMetadataBuilder
