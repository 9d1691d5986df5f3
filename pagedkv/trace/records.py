"""The records of a `StepTrace`: plain data (ints, strings, lists), so they survive JSON.

`EngineInfo` holds what is fixed at start-up (layers, KV cache groups, attention groups);
each `StepRecord` one step, with its requests, slot mappings, metadata and block pools.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any


@dataclass
class KVSpecInfo:
    """A KV cache spec (what one block of one layer holds), flattened."""

    kind: str
    """Spec class name: "FullAttentionSpec", "SlidingWindowSpec" or "MLAAttentionSpec"."""
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None


@dataclass
class KVCacheGroupInfo:
    """Layers that share one block table, one backing buffer and one slot mapping."""

    group_id: int
    layer_names: list[str]
    spec: KVSpecInfo


@dataclass
class AttentionGroupInfo:
    """Layers of one KV cache group with one backend: one builder, one metadata object per step."""

    kv_cache_group_id: int
    backend: str
    builder: str
    layer_names: list[str]
    spec: KVSpecInfo
    num_heads: int


@dataclass
class EngineInfo:
    """What is fixed at start-up: model, cache geometry, groups. Recorded once per trace."""

    model: str
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    """Blocks per KV cache group, the null block 0 included."""
    max_num_batched_tokens: int
    max_num_seqs: int
    layer_names: list[str]
    kv_cache_groups: list[KVCacheGroupInfo]
    attention_groups: list[AttentionGroupInfo]
    kv_cache_shapes: dict[str, list[int]]
    """Layer name -> shape of the KV cache tensor bound to that layer."""
    cudagraph_mode: str = "NONE"
    """The CUDA graph mode the engine resolved at start-up (traces older than this field: NONE)."""
    cudagraph_capture_sizes: list[int] = dataclasses.field(default_factory=list)
    """Padded token counts with graphs; empty without graphs."""
    prefix_caching: bool = False
    """Whether full blocks were hashed and shared between requests (traces older than this field: off)."""

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.kv_cache_groups)

    def group_of(self, layer_name: str) -> AttentionGroupInfo:
        """The attention group a layer belongs to."""
        return next(g for g in self.attention_groups if layer_name in g.layer_names)


@dataclass
class RequestRecord:
    """One request's part of a step. Requests that hold blocks but were not scheduled have
    phase "unscheduled" and `num_new_tokens` 0 (their blocks still show in the pool)."""

    req_id: str
    phase: str
    """"prefill" (prompt or recomputed tokens), "decode" (one new token, or with speculative decoding
    its last known token and the drafts after it), or "unscheduled"."""
    num_computed_tokens: int
    """Tokens whose K/V were already in the cache before this step."""
    num_new_tokens: int
    """Tokens computed in this step: positions num_computed_tokens ... + num_new_tokens - 1."""
    num_prompt_tokens: int
    block_ids: list[list[int]]
    """Per KV cache group, the request's block-table row during the step (0 = null block)."""
    num_cached_tokens: int = 0
    """Tokens found in the prefix cache when the request was admitted in this step: its first
    num_cached_tokens tokens (whole blocks) were not computed. 0 in every other step."""
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Speculative decoding: the proposed tokens this step verified, at its last len(draft_token_ids)
    positions ([] without drafts, and in traces recorded before this field)."""
    num_accepted_tokens: int | None = None
    """Drafts the target accepted (a prefix of them); None without drafts. The rejected ones' K/V
    were written in this step and rolled back after it: num_computed_tokens goes back past them."""
    rolled_back_block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    """Per KV cache group, blocks the rollback gave back (they held only rejected tokens); [] per group
    or no list at all when nothing was rolled back."""
    emitted_token_ids: list[int] = dataclasses.field(default_factory=list)
    """With drafts: the tokens the step emitted, the accepted drafts and then the target's own token
    (a correction, or a bonus when all were accepted); fewer when the request finished on one of them."""

    @property
    def num_rejected_tokens(self) -> int:
        """Drafts the target rejected: their positions are the step's last ones."""
        return len(self.draft_token_ids) - (self.num_accepted_tokens or 0)


@dataclass
class MetadataRecord:
    """One attention-metadata object built in a step, and every layer that received it."""

    type_name: str
    layer_names: list[str]
    fields: dict[str, str]
    """Field name -> a short printable summary (tensors: shape, dtype and small values)."""


@dataclass
class MLASplitRecord:
    """How an MLA backend split one step's batch: the leading `num_decodes` requests (one query
    token each) went to forward_mqa, the other requests to forward_mha.

    It is the split the metadata builder made, by query length, so it can differ from the
    scheduler's phases: a prompt's last chunk of one token, placed right after the decodes, is a
    "decode" here (`split_decodes_and_prefills`)."""

    num_decodes: int
    num_decode_tokens: int
    """Tokens 0 .. num_decode_tokens - 1 of the step: the forward_mqa rows."""
    num_prefills: int
    num_prefill_tokens: int


SHORT_HASH_CHARS = 8
"""Hex digits of a block hash kept in a trace: enough to tell a step's blocks apart by eye."""


@dataclass
class BlockPoolRecord:
    """One KV cache group's block pool after a step: who holds each block, which blocks hold a
    cached prefix, and the order in which free blocks are handed out (evicted) again.

    A free block whose hash is set is *evictable*: a request with that prefix can still take it
    back, until the head of the free queue reaches it and a new allocation overwrites it.
    Stored sparsely (a GPU cache has thousands of blocks, most of them free and uncached every
    step); `ref_cnts` and `block_hashes` spell it out per block id."""

    num_blocks: int
    held: list[list[int]]
    """[block id, ref count] of every block some block table holds (the null block 0 included)."""
    cached: list[list[int | str]]
    """[block id, the first SHORT_HASH_CHARS hex digits of its hash] of every cached block."""
    free_queue: list[list[int]]
    """Free block ids in eviction order, head (the next block handed out) first, as runs
    [first, last] of consecutive ids: a fresh pool is the one run [1, num_blocks - 1]."""

    @functools.cached_property
    def ref_cnts(self) -> list[int]:
        """Per block id: block tables holding it after the step; 0 = free (the null block 0 keeps 1)."""
        counts = [0] * self.num_blocks
        for block, ref_cnt in self.held:
            counts[block] = ref_cnt
        return counts

    @functools.cached_property
    def block_hashes(self) -> list[str | None]:
        """Per block id: its short hash, None while not cached."""
        hashes: list[str | None] = [None] * self.num_blocks
        for block, short_hash in self.cached:
            hashes[int(block)] = str(short_hash)
        return hashes

    def free_queue_order(self) -> list[int]:
        """The free block ids, head of the queue first (the runs spelled out)."""
        return [b for first, last in self.free_queue for b in range(first, last + 1)]

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def evictable(self) -> list[int]:
        """Free blocks that still hold a cached prefix, in eviction order."""
        cached = {int(block) for block, _ in self.cached}
        return [b for b in self.free_queue_order() if b in cached]


@dataclass
class StepRecord:
    """Everything one engine step did that the widgets draw."""

    step: int
    """The engine's step number (1 = its first step ever)."""
    requests: list[RequestRecord]
    """Scheduled requests in batch order (decodes first), then unscheduled block holders."""
    input_ids: list[int]
    positions: list[int]
    slot_mappings: list[list[int]]
    """Per KV cache group, the cache slot of each token of the step (-1 = padding)."""
    num_blocks_in_use: list[int]
    """Per KV cache group, distinct non-null blocks held during the step."""
    num_free_blocks: list[int]
    """Per KV cache group, free blocks after the step (finished requests gave theirs back)."""
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    metadata: list[MetadataRecord]
    """The distinct metadata objects of the step, in the order the layers received them."""
    attn_metadata_keys: list[str]
    """Layer names under which the forward context held attention metadata."""
    slot_mapping_keys: list[str]
    """Layer names under which the forward context held a slot mapping."""
    cudagraph_mode: str
    """How the step ran: "FULL" (a graph replayed), "PIECEWISE" or "NONE" (eager)."""
    batch_descriptor: dict[str, Any]
    """The dispatcher's key: with a graph, `num_tokens` is the padded count (the step's own
    tokens are `input_ids`; the padding, slot -1, is not recorded)."""
    duration_s: float
    """Model + sampling time of the step."""
    mla_split: MLASplitRecord | None = None
    """The decode / prefill split of the step's MLA layers; None without MLA layers (and in traces
    recorded before this field)."""
    block_pools: list[BlockPoolRecord] = dataclasses.field(default_factory=list)
    """Per KV cache group, its block pool after the step (empty in traces recorded before this field)."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the step's admitted requests that were found in the prefix cache."""
        return sum(r.num_cached_tokens for r in self.requests)

    @property
    def scheduled(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.num_new_tokens > 0]

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests if r.phase == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests if r.phase == "decode")

    def token_req_ids(self) -> list[str]:
        """The request each token of the step belongs to (tokens are packed request after request)."""
        return [r.req_id for r in self.scheduled for _ in range(r.num_new_tokens)]

    def metadata_index(self, layer_name: str) -> int:
        """Which of `self.metadata` the layer received: equal indices = the very same object."""
        return next(i for i, m in enumerate(self.metadata) if layer_name in m.layer_names)
