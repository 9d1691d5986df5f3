"""TRITON_MLA: decodes by the Triton paged MLA kernel (`pagedkv.kernels.mla_decode`), with split-KV.

    builder (one per attention group)  allocates the split-KV scratch once; per step it splits
                                       the batch (decodes first) and picks the decode kernel's
                                       split count on the host, once for every layer
    impl (one per layer)               do_kv_cache_update -> concat_and_cache_mla
                                       forward_mqa        -> mla_decode_attention (+ merge)
                                       forward_mha        -> the prefills in passes of up to
                                                             32768 sequence tokens: their cached
                                                             latents gathered and up-projected
                                                             once per pass, then the paged
                                                             attention kernel

A pure-decode step reads nothing back from the device and allocates no scratch per layer (the
builder's split-KV workspace is shared; the per-layer outputs come from the graph's memory
pool when captured), so it can be captured as a full CUDA graph (UNIFORM_SINGLE_TOKEN_DECODE); steps with prefills run
eagerly. The prefills' gather indices are built once per step by the builder, so a layer's
forward_mha neither loops over requests nor copies anything from the host.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pagedkv.attention.backend import AttentionCGSupport, CommonAttentionMetadata, MultipleOf
from pagedkv.attention.backends.triton_attn import TritonBackendRules
from pagedkv.attention.mla.common import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadataBuilder,
    MLADecodeMetadata,
    MLAPrefillMetadata,
)
from pagedkv.config import EngineConfig
from pagedkv.kernels import HAS_TRITON
from pagedkv.kernels.common import cdiv, head_size_supported
from pagedkv.kv_cache.spec import KVCacheSpec

if HAS_TRITON:
    from pagedkv.kernels import unified_attention
    from pagedkv.kernels.mla_decode import MLADecodeWorkspace, default_num_kv_splits, mla_decode_attention


@dataclass
class TritonMLADecodeMetadata(MLADecodeMetadata):
    """The decode part, plus the kernel's scratch and split count."""

    workspace: MLADecodeWorkspace | None = None
    num_kv_splits: int = 1


@dataclass
class PrefillPass:
    """Prefills attended together by one call of the paged attention kernel (`unified_attention`).

    Their cache blocks are gathered back to back and up-projected at once; the kernel then reads
    the per-head K and V as a paged cache of their own, each request's blocks in order::

        gathered blocks:  | a0 a1 a2 | b0 b1 | c0 ...        block_table[a] = 0 1 2
                                                            block_table[b] = 3 4
    """

    tokens: slice
    """This pass's query rows among the step's prefill tokens."""
    blocks: torch.Tensor
    """int64 [num_blocks]: the requests' cache blocks, request after request."""
    block_table: torch.Tensor
    """int32 [requests, max_blocks]: each request's blocks in the gathered copy."""
    query_start_loc: torch.Tensor
    """int32 [requests + 1] on the device, counted from the pass's first token."""
    seq_lens: torch.Tensor
    """int32 [requests] on the device."""
    max_query_len: int
    max_seq_len: int


@dataclass
class TritonMLAPrefillMetadata(MLAPrefillMetadata):
    """The prefill part in passes whose up-projected K and V stay within a token budget; a request
    longer than the budget on its own takes the shared chunked path instead (`long_requests`: its
    query rows and its own one-request metadata)."""

    passes: list[PrefillPass] = field(default_factory=list)
    long_requests: list[tuple[slice, MLAPrefillMetadata]] = field(default_factory=list)


class TritonMLAMetadataBuilder(MLACommonMetadataBuilder):
    """Holds the split-KV scratch; once per step for all layers, picks the decode kernel's split
    count and groups the prefills into passes."""

    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    prefill_tokens_per_pass: ClassVar[int] = 32768
    """Most sequence tokens (cached + new) one prefill pass up-projects: K and V take
    heads x (qk_head_dim + v_head_dim) values per token (16 x (192 + 128) x 2 B = 10 KiB in bf16
    for DeepSeek-V2-Lite). A request longer than this goes through a loop of its own."""

    def __init__(
        self, kv_cache_spec: KVCacheSpec, layer_names: list[str], config: EngineConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        layer = config.compilation_config.static_forward_context[layer_names[0]]
        self.num_heads, self.kv_lora_rank = layer.num_heads, layer.mla_dims.kv_lora_rank
        # All layers of the group run one after another, so they share one scratch buffer.
        self.workspace = MLADecodeWorkspace(
            config.scheduler_config.max_num_seqs, self.num_heads, self.kv_lora_rank, device
        )

    def build_prefill(self, prefill: MLAPrefillMetadata) -> MLAPrefillMetadata:
        return group_prefill_passes(prefill, self.kv_cache_spec.block_size, self.prefill_tokens_per_pass, self.device)

    def build_decode(
        self, cm: CommonAttentionMetadata, num_decodes: int, seq_lens_cpu: list[int], max_seq_len: int
    ) -> MLADecodeMetadata:
        common = super().build_decode(cm, num_decodes, seq_lens_cpu, max_seq_len)
        splits = default_num_kv_splits(
            num_decodes,
            self.num_heads,
            max_seq_len,
            self.kv_cache_spec.block_size,
            self.kv_cache_spec.dtype,
            self.device,
        )
        return TritonMLADecodeMetadata(
            **common.__dict__, workspace=self.workspace, num_kv_splits=min(splits, self.workspace.rows // num_decodes)
        )


def group_prefill_passes(
    prefill: MLAPrefillMetadata,
    block_size: int,
    tokens_per_pass: int,
    device: torch.device,
) -> TritonMLAPrefillMetadata:
    """Group the prefills into passes of whole requests, in order, each within `tokens_per_pass`
    sequence tokens; a request longer than that on its own goes to `long_requests`."""
    passes: list[PrefillPass] = []
    long_requests: list[tuple[slice, MLAPrefillMetadata]] = []
    group: list[int] = []
    group_tokens = 0
    for i, seq_len in enumerate(prefill.seq_lens_cpu):
        too_long = seq_len > tokens_per_pass
        if group and (too_long or group_tokens + seq_len > tokens_per_pass):
            passes.append(_prefill_pass(prefill, group, block_size, device))
            group, group_tokens = [], 0
        if too_long:
            a, b = prefill.query_start_loc_cpu[i], prefill.query_start_loc_cpu[i + 1]
            long_requests.append(
                (
                    slice(a, b),
                    MLAPrefillMetadata(
                        [0, b - a], [seq_len], prefill.block_table[i : i + 1], prefill.context_chunk_tokens
                    ),
                )
            )
        else:
            group.append(i)
            group_tokens += seq_len
    if group:
        passes.append(_prefill_pass(prefill, group, block_size, device))
    return TritonMLAPrefillMetadata(**prefill.__dict__, passes=passes, long_requests=long_requests)


def _prefill_pass(
    prefill: MLAPrefillMetadata, requests: list[int], block_size: int, device: torch.device
) -> PrefillPass:
    """Host-side lists -> a few small device tensors, once per step (every layer reuses them)."""
    seq_lens = [prefill.seq_lens_cpu[i] for i in requests]
    num_blocks = [cdiv(n, block_size) for n in seq_lens]
    first = [0, *itertools.accumulate(num_blocks)]  # each request's first block in the gathered copy
    rows = torch.tensor([r for r, n in zip(requests, num_blocks) for _ in range(n)], device=device)
    cols = torch.tensor([j for n in num_blocks for j in range(n)], device=device)
    table = torch.tensor(first[:-1])[:, None] + torch.arange(max(num_blocks))[None, :]
    starts = prefill.query_start_loc_cpu
    tokens = slice(starts[requests[0]], starts[requests[-1] + 1])
    query_start_loc = [starts[i] - tokens.start for i in requests] + [tokens.stop - tokens.start]
    return PrefillPass(
        tokens=tokens,
        blocks=prefill.block_table[rows, cols].long(),
        # Entries past a request's own blocks are never read (the kernel stops at seq_len).
        block_table=table.clamp(max=first[-1] - 1).to(device, torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
        max_seq_len=max(seq_lens),
    )


class TritonMLAImpl(MLACommonImpl[TritonMLADecodeMetadata]):
    """forward_mqa by `mla_decode_attention`, forward_mha by `unified_attention` over up-projected K and V."""

    @functools.cached_property
    def kernel_takes_heads(self) -> bool:
        """Whether `unified_attention` takes this layer's head sizes (K's and V's, which differ).
        Fixed by the layer's shape, so worked out once per layer, not in every forward."""
        dims = self.mla_dims
        return head_size_supported(dims.qk_head_dim) and head_size_supported(dims.v_head_dim)

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        prefill: MLAPrefillMetadata,
        output: torch.Tensor,
    ) -> None:
        """Each pass: gather the requests' latent rows (this step's are in the cache already),
        up-project them to per-head K and V, then one causal paged attention over all requests,
        every request's new tokens placed after its cached ones::

            request: |---- context (cached) ----|---- query (this step) ----|
                      all visible to the queries    causal among themselves

        Head sizes the kernel does not take, and requests too long for one pass, go through the
        shared path (a loop over requests, context in chunks, merged by log-sum-exp)."""
        dims = self.mla_dims
        if not isinstance(prefill, TritonMLAPrefillMetadata) or not self.kernel_takes_heads:
            super().forward_mha(q, kv_c_normed, k_pe, kv_cache, prefill, output)
            return
        for rows, alone in prefill.long_requests:
            super().forward_mha(q[rows], kv_c_normed[rows], k_pe[rows], kv_cache, alone, output[rows])
        for p in prefill.passes:
            latents = kv_cache[p.blocks]  # [blocks, block_size, latent]
            k, v = self._up_project(*torch.split(latents.flatten(0, 1), [dims.kv_lora_rank, dims.qk_rope_head_dim], -1))
            paged = (latents.shape[0], latents.shape[1], self.num_heads)  # the gathered blocks, as pages
            unified_attention(  # K of qk_head_dim values, V (and the output) of v_head_dim
                q[p.tokens].to(k.dtype),
                k.view(*paged, dims.qk_head_dim),
                v.view(*paged, dims.v_head_dim),
                output[p.tokens],
                query_start_loc=p.query_start_loc,
                seq_lens=p.seq_lens,
                max_query_len=p.max_query_len,
                max_seq_len=p.max_seq_len,
                block_table=p.block_table,
                softmax_scale=self.scale,
            )

    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor, decode: TritonMLADecodeMetadata) -> torch.Tensor:
        out = torch.empty(*q.shape[:2], self.mla_dims.kv_lora_rank, dtype=q.dtype, device=q.device)
        return mla_decode_attention(
            q,
            kv_cache,
            decode.block_table,
            decode.seq_lens,
            self.scale,
            self.mla_dims.kv_lora_rank,
            out,
            workspace=decode.workspace,
            num_kv_splits=decode.num_kv_splits,
            early_launch=True,  # block_table and seq_lens are the step's metadata, written before any layer ran
        )


class TritonMLABackend(TritonBackendRules, MLACommonBackend):
    """Triton MLA decode: CUDA, or the CPU under Triton's interpreter (slow; for learning)."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    # No fp8 latent cache: mla_decode and the prefill's gather read the cache in the model dtype, so the
    # selector refuses "fp8" here with the declared list (TRITON_ATTN dequantizes an MHA cache on load).
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
