"""What every MLA backend shares: the batch split, its metadata, and the two attention paths.

Multi-head latent attention (DeepSeek-V2/V3) caches one latent row per token,
`[ c_kv (kv_lora_rank) | k_pe (rope) ]`, and gets each head's K and V back through kv_b_proj:

    k_nope[h] = W_UK[h] @ c_kv        v[h] = W_UV[h] @ c_kv        (kv_b_proj = [W_UK; W_UV] per head)

Two ways to attend, with the same result (tests/attention/test_mla.py checks that they agree):

    forward_mha (prefills: many query tokens, compute-bound)
        up-project every cached latent to per-head K and V, ordinary causal attention
        score = q_nope . (W_UK c) + q_pe . k_pe

    forward_mqa (decodes: one query token, bound by reading the cache)
        absorb W_UK into the query once:  q_nope . (W_UK c) = (W_UK^T q_nope) . c
        then every head attends over the SAME latent rows: multi-query attention with one
        KV head of size kv_lora_rank + rope, whose "values" are the c_kv part; W_UV after:
        out[h] = W_UV[h] @ sum_j p_j c_j

The batch comes decodes first (the scheduler orders it so; in vLLM, Model Runner V2 does); `split_decodes_and_prefills`
finds where the decodes end, and `MLACommonImpl.forward` sends each part to its path:

    tokens  | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1  |
            | forward_mqa -|--------- forward_mha ---------|
            0              num_decode_tokens               num_actual_tokens
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA layer (DeepSeek-V2-Lite: 512, 128, 64, 128)."""

    kv_lora_rank: int
    """Size of the latent c_kv that is cached instead of K and V."""
    qk_nope_head_dim: int
    """Per-head query/key dims without position (keys come from c_kv)."""
    qk_rope_head_dim: int
    """Per-head query dims with RoPE; the key part is one shared k_pe per token, cached."""
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Values per cached token: c_kv and k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def split_decodes_and_prefills(cm: CommonAttentionMetadata, decode_threshold: int = 1) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a decodes-first batch.

    The decodes are the leading requests with at most `decode_threshold` query tokens; every
    request from the first longer one on is a prefill (a whole prompt or a chunk of it). A
    one-token request after a prefill counts as a prefill: both paths are right for any query.
    """
    query_lens = cm.query_lens_cpu[: cm.num_reqs]
    longer = (query_lens > decode_threshold).nonzero()
    num_decodes = int(longer[0, 0]) if len(longer) else cm.num_reqs
    num_decode_tokens = int(cm.query_start_loc_cpu[num_decodes])
    return num_decodes, cm.num_reqs - num_decodes, num_decode_tokens, cm.num_actual_tokens - num_decode_tokens


@dataclass
class MLADecodeMetadata:
    """The decodes' rows of the batch: one query token each, at the end of its sequence."""

    block_table: torch.Tensor
    """int32 [num_decodes, max_blocks]."""
    seq_lens: torch.Tensor
    """int32 [num_decodes] on the device."""
    seq_lens_cpu: list[int]
    max_seq_len: int
    """Host-side bound on seq_lens (sizes a kernel's split-KV grid)."""


@dataclass
class MLAPrefillMetadata:
    """The prefills' rows: query positions counted from the first prefill token."""

    query_start_loc_cpu: list[int]
    """[num_prefills + 1], starting at 0."""
    seq_lens_cpu: list[int]
    block_table: torch.Tensor
    """int32 [num_prefills, max_blocks]."""
    context_chunk_tokens: int
    """Cached context is up-projected at most this many tokens at a time (bounds the K/V of
    a long context that forward_mha materialises)."""


D = TypeVar("D", bound=MLADecodeMetadata)


@dataclass
class MLACommonMetadata(Generic[D]):
    """One step's MLA metadata: the split, and each part's own metadata (None when empty)."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    decode: D | None
    prefill: MLAPrefillMetadata | None


class MLACommonMetadataBuilder(AttentionMetadataBuilder[MLACommonMetadata[Any]]):
    """Splits the batch at the last decode and builds each part's metadata."""

    context_chunk_tokens: ClassVar[int] = 4096
    """forward_mha up-projects cached context in chunks of at most this many tokens."""

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata[Any]:
        return self._build(common_attn_metadata, max_seq_len=None)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata[Any]:
        """A graph keeps the launch it was captured with for every batch replayed in it, so the
        decode part is sized for the longest sequence the model allows, not the dummy batch's."""
        return self._build(common_attn_metadata, max_seq_len=self.config.model_config.max_model_len)

    def _build(self, cm: CommonAttentionMetadata, max_seq_len: int | None) -> MLACommonMetadata[Any]:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(cm)
        seq_lens_cpu = cm.seq_lens_cpu[: cm.num_reqs].tolist()
        prefill = None
        if num_prefills:
            starts = cm.query_start_loc_cpu[num_decodes : cm.num_reqs + 1] - num_decode_tokens
            prefill = self.build_prefill(
                MLAPrefillMetadata(
                    query_start_loc_cpu=starts.tolist(),
                    seq_lens_cpu=seq_lens_cpu[num_decodes:],
                    block_table=cm.block_table_tensor[num_decodes : cm.num_reqs],
                    context_chunk_tokens=self.context_chunk_tokens,
                )
            )
        decode = None
        if num_decodes:
            decode_lens = seq_lens_cpu[:num_decodes]
            decode = self.build_decode(cm, num_decodes, decode_lens, max_seq_len or max(decode_lens))
        return MLACommonMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            slot_mapping=cm.slot_mapping,
            decode=decode,
            prefill=prefill,
        )

    def build_prefill(self, prefill: MLAPrefillMetadata) -> MLAPrefillMetadata:
        """The prefill part; a backend whose forward_mha needs more (device-side indices built once
        per step for every layer) overrides this."""
        return prefill

    def build_decode(
        self, cm: CommonAttentionMetadata, num_decodes: int, seq_lens_cpu: list[int], max_seq_len: int
    ) -> MLADecodeMetadata:
        """The decode part; a backend whose kernel needs more (scratch, splits) overrides this.
        `max_seq_len` bounds every decode's length (the model's limit when capturing a graph)."""
        return MLADecodeMetadata(
            block_table=cm.block_table_tensor[:num_decodes],
            seq_lens=cm.seq_lens[:num_decodes],
            seq_lens_cpu=seq_lens_cpu,
            max_seq_len=max_seq_len,
        )


def concat_and_cache_mla(
    kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's latent row [c_kv | k_pe] into its slot of `kv_cache`
    [num_blocks, block_size, latent_size].

    Padding tokens (slot -1) are sent to slot 0, in block 0, the null block no request owns:
    no boolean mask means no device-to-host sync, so a CUDA graph can capture the write.
    """
    n = slot_mapping.shape[0]
    rows = torch.cat([kv_c_normed[:n], k_pe[:n]], dim=-1).to(kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping.clamp(min=0), rows)


def gather_latents(kv_cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Cached latent rows of positions [start, end) of one request, through its block table row."""
    block_size = kv_cache.shape[1]
    blocks = block_row[start // block_size : -(-end // block_size)].long()
    first = start - (start // block_size) * block_size
    return kv_cache[blocks].flatten(0, 1)[first : first + end - start]


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v in float32, and the log-sum-exp of the scores per query and head.

    q [Q, H, Dk], k [S, H, Dk], v [S, H, Dv]. With `causal_offset`, query i sits at position
    causal_offset + i among the keys and sees keys up to it; None: every key is visible.
    """
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal_offset is not None:
        q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > q_pos, float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [H, Q]
    out = torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), v.float())
    return out, lse.transpose(0, 1)  # [Q, H, Dv], [Q, H]


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from the attention over each: weights exp(lse_x - lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]
    return out, lse


M = TypeVar("M", bound=MLADecodeMetadata)


class MLACommonImpl(AttentionImpl[MLACommonMetadata[M]]):
    """One MLA layer's attention: cache write, then decodes by forward_mqa, prefills by forward_mha.

    A backend implements `forward_mqa` (the decode kernel over the latent cache); the prefill
    path, the weight absorption and the split are the same for all.

    vLLM's counterpart is MLAAttentionImpl: its constructor also gets the kv_b_proj layer, and its
    layer (MLAAttention) makes the split. Here the impl's `forward` makes it, so the layer stays a
    plain `Attention`, and kv_b_proj's weight arrives in `process_weights_after_loading`.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
        kv_cache_dtype: torch.dtype,
        attn_type: AttentionType = AttentionType.DECODER,
        *,
        mla_dims: MLADims,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, kv_cache_dtype, attn_type)
        self.mla_dims = mla_dims
        self.W_UK: torch.Tensor | None = None
        """[heads, qk_nope_head_dim, kv_lora_rank]: c_kv -> each head's k_nope (vLLM's W_UK_T: the
        same tensor, named by the other convention)."""
        self.W_UV_T: torch.Tensor | None = None
        """[heads, kv_lora_rank, v_head_dim]: latent attention output -> each head's output (vLLM's W_UV)."""
        self.kv_b_weight: torch.Tensor | None = None

    def process_weights_after_loading(self, kv_b_proj_weight: torch.Tensor) -> None:
        """Split kv_b_proj's weight [heads * (nope + v), kv_lora_rank] into W_UK and W_UV
        (views of the loaded weight: no copy, and nothing goes stale)."""
        dims = self.mla_dims
        w = kv_b_proj_weight.view(self.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
        self.kv_b_weight = kv_b_proj_weight
        self.W_UK = w[:, : dims.qk_nope_head_dim]
        self.W_UV_T = w[:, dims.qk_nope_head_dim :].transpose(1, 2)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata[M] | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """q [tokens, heads, qk_head_dim] (RoPE applied), kv_c_normed [tokens, kv_lora_rank],
        k_pe [tokens, rope] -> output [tokens, heads, v_head_dim]. The cache already holds this
        step's rows (the cache-update op ran first)."""
        if attn_metadata is None:  # profile run: shapes only
            return output.zero_()
        if self.W_UK is None or self.W_UV_T is None:
            raise RuntimeError(
                "MLA weights are not split yet: call process_weights_after_loading() on the model's "
                "MLAAttention layers after loading kv_b_proj (load_model does)."
            )
        md = attn_metadata
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        if md.decode is not None:
            q_nope, q_pe = torch.split(q[:nd], [self.mla_dims.qk_nope_head_dim, self.mla_dims.qk_rope_head_dim], dim=-1)
            # Absorb W_UK: [heads, tokens, nope] @ [heads, nope, kv_lora_rank] -> latent-space queries.
            ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK).transpose(0, 1)
            latent_out = self.forward_mqa(torch.cat([ql_nope, q_pe], dim=-1), kv_cache, md.decode)
            output[:nd] = self._v_up_proj(latent_out)
        if md.prefill is not None:
            self.forward_mha(q[nd:n], kv_c_normed[nd:n], k_pe[nd:n], kv_cache, md.prefill, output[nd:n])
        output[n:].zero_()  # padding rows
        return output

    def _v_up_proj(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, kv_lora_rank] -> [tokens, heads, v_head_dim]: W_UV, head by head."""
        assert self.W_UV_T is not None
        return torch.bmm(latent_out.transpose(0, 1).to(self.W_UV_T.dtype), self.W_UV_T).transpose(0, 1)

    @abstractmethod
    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor, decode: M) -> torch.Tensor:
        """Decode attention in latent space: q [num_decodes, heads, latent_size] (W_UK absorbed)
        over each request's cached rows -> [num_decodes, heads, kv_lora_rank]."""

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        prefill: MLAPrefillMetadata,
        output: torch.Tensor,
    ) -> None:
        """Prefill attention with per-head K and V: the new tokens' own latents (causal), then the
        cached context in chunks, merged by log-sum-exp::

            request: |---- context (cached) ----|---- query (this step) ----|
                      chunk 0 | chunk 1 | ...      causal among themselves
        """
        for i, seq_len in enumerate(prefill.seq_lens_cpu):
            start, end = prefill.query_start_loc_cpu[i], prefill.query_start_loc_cpu[i + 1]
            context_len = seq_len - (end - start)
            q_i = q[start:end]
            out, lse = attention_with_lse(
                q_i, *self._up_project(kv_c_normed[start:end], k_pe[start:end]), self.scale, causal_offset=0
            )
            for c in range(0, context_len, prefill.context_chunk_tokens):
                rows = gather_latents(
                    kv_cache, prefill.block_table[i], c, min(c + prefill.context_chunk_tokens, context_len)
                )
                k, v = self._up_project(
                    *torch.split(rows, [self.mla_dims.kv_lora_rank, self.mla_dims.qk_rope_head_dim], -1)
                )
                out, lse = merge_attn_states(out, lse, *attention_with_lse(q_i, k, v, self.scale, causal_offset=None))
            output[start:end] = out.to(output.dtype)

    def _up_project(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [S, kv_lora_rank] and rope keys [S, rope] -> per-head K [S, H, qk_head_dim], V [S, H, v]."""
        assert self.kv_b_weight is not None
        dims = self.mla_dims
        kv = (kv_c.to(self.kv_b_weight.dtype) @ self.kv_b_weight.T).view(
            -1, self.num_heads, dims.qk_nope_head_dim + dims.v_head_dim
        )
        k_nope, v = torch.split(kv, [dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].to(k_nope.dtype).expand(-1, self.num_heads, -1)], dim=-1)
        return k, v


class MLACommonBackend(AttentionBackend):
    """Rule book shared by MLA backends: MLA layers only, a latent cache of one row per token."""

    forward_includes_kv_cache_update = False
    is_mla = True
    supports_sliding_window = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """[num_blocks, block_size, kv_lora_rank + rope]: no K/V pair, no heads."""
        return (num_blocks, block_size, head_size)
