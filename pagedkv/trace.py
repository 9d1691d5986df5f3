"""`StepTrace`: a recording of what the engine did in each step, as plain data.

    trace = StepTrace.attach(llm)          # listens to every llm.step() from now on
    llm.generate(prompts, params)
    trace.detach()
    trace[0].requests, trace[0].slot_mappings, trace.engine.attention_groups
    trace[0].mla_split                     # MLA models: which tokens went to forward_mqa / forward_mha
    trace[0].block_pools[0].free_queue     # each group's pool after the step: ref counts, hashes, eviction order
    trace.save("run.json"); StepTrace.load("run.json")   # replay a GPU run on a laptop

Nothing here holds a tensor or a reference into the engine: every record is ints, strings
and lists, so a trace survives JSON and a view draws a replayed step exactly as it drew it
live. When no trace is attached, the engine does not even build its `StepEvent`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.attention.mla.common import MLACommonMetadata

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM, StepEvent
    from pagedkv.kv_cache.block_pool import BlockPool
    from pagedkv.kv_cache.spec import KVCacheSpec

TRACE_FORMAT = "pagedkv-trace"
TRACE_VERSION = 1


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
    """"prefill" (prompt or recomputed tokens), "decode" (one new token), or "unscheduled"."""
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


class StepTrace:
    """A list of `StepRecord`s plus the `EngineInfo` they refer to; fills itself while attached."""

    def __init__(self, engine: EngineInfo, steps: list[StepRecord] | None = None) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = steps if steps is not None else []
        self._observers: list[Callable[[StepRecord], None]] = []
        self._llm: LLM | None = None
        self._detach: Callable[[], None] | None = None
        self._last_model_time = 0.0

    # ---- recording -------------------------------------------------------------------

    @classmethod
    def attach(cls, llm: LLM) -> StepTrace:
        """A new trace that records every step `llm` runs until `detach()`."""
        trace = cls(engine_info(llm))
        trace._llm = llm
        trace._last_model_time = llm.stats.model_time_s
        trace._detach = llm.add_step_listener(trace._record)
        return trace

    def detach(self) -> None:
        """Stop recording (the steps so far stay)."""
        if self._detach is not None:
            self._detach()
        self._detach, self._llm = None, None

    @property
    def is_live(self) -> bool:
        return self._detach is not None

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def observe(self, callback: Callable[[StepRecord], None]) -> None:
        """Call `callback(record)` after each newly recorded step (how live widgets update)."""
        self._observers.append(callback)

    def _record(self, event: StepEvent) -> None:
        assert self._llm is not None
        model_time = self._llm.stats.model_time_s
        record = step_record(event, self._llm, model_time - self._last_model_time)
        self._last_model_time = model_time
        self.append(record)

    def append(self, record: StepRecord) -> None:
        self.steps.append(record)
        for callback in list(self._observers):
            callback(record)

    # ---- reading -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> StepRecord:
        return self.steps[index]

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self.steps)

    def step_numbers(self) -> list[int]:
        return [r.step for r in self.steps]

    def req_ids(self) -> list[str]:
        """Every request seen in the trace, in order of first appearance."""
        seen: dict[str, None] = {}
        for record in self.steps:
            seen.update(dict.fromkeys(r.req_id for r in record.requests))
        return list(seen)

    def __repr__(self) -> str:
        state = "live" if self.is_live else "recorded"
        return (
            f"StepTrace({len(self.steps)} steps, {state}, model={self.engine.model!r}, "
            f"{self.engine.num_blocks} blocks x {self.engine.block_size} tokens, "
            f"{self.engine.num_kv_cache_groups} KV cache group(s))"
        )

    # ---- JSON --------------------------------------------------------------------------

    def to_json(self) -> str:
        payload = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "engine": dataclasses.asdict(self.engine),
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }
        return json.dumps(payload, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StepTrace:
        payload = json.loads(text)
        if payload.get("format") != TRACE_FORMAT or payload.get("version") != TRACE_VERSION:
            raise ValueError(
                f"Not a {TRACE_FORMAT} v{TRACE_VERSION} file "
                f"(format={payload.get('format')!r}, version={payload.get('version')!r})."
            )
        return cls(
            _from_plain(EngineInfo, payload["engine"]),
            [_from_plain(StepRecord, s) for s in payload["steps"]],
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepTrace:
        return cls.from_json(Path(path).read_text())


def _from_plain(tp: Any, value: Any) -> Any:
    """Rebuild a (nested) dataclass from what `dataclasses.asdict` + JSON made of it.

    A field missing from an older trace takes its default (a field without one is required).
    """
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [f.name for f in dataclasses.fields(tp) if f.name in value]
        return tp(**{name: _from_plain(hints[name], value[name]) for name in fields})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [_from_plain(args[0], v) for v in value]
    if origin is dict:
        return {k: _from_plain(args[1], v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType) and value is not None:
        return _from_plain(next(a for a in args if a is not type(None)), value)
    return value


# ---- turning engine objects into records ------------------------------------------------


def _spec_info(spec: KVCacheSpec) -> KVSpecInfo:
    return KVSpecInfo(
        kind=type(spec).__name__,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        sliding_window=getattr(spec, "sliding_window", None),
    )


def engine_info(llm: LLM) -> EngineInfo:
    """The start-up facts of `llm` that every step record refers to."""
    runner, config = llm.runner, llm.config
    kv_config = runner.kv_cache_config
    return EngineInfo(
        model=config.model_config.model,
        device=str(runner.device),
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        block_size=config.cache_config.block_size,
        num_blocks=kv_config.num_blocks,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        layer_names=list(runner.attn_layers),
        kv_cache_groups=[
            KVCacheGroupInfo(i, list(g.layer_names), _spec_info(g.kv_cache_spec))
            for i, g in enumerate(kv_config.kv_cache_groups)
        ],
        attention_groups=[
            AttentionGroupInfo(
                kv_cache_group_id=g.kv_cache_group_id,
                backend=g.backend.get_name(),
                builder=type(g.metadata_builder).__name__,
                layer_names=list(g.layer_names),
                spec=_spec_info(g.kv_cache_spec),
                num_heads=g.num_heads,
            )
            for groups in runner.attn_groups
            for g in groups
        ],
        kv_cache_shapes={name: list(layer.kv_cache.shape) for name, layer in runner.attn_layers.items()},
        cudagraph_mode=runner.cudagraph_mode.name,
        cudagraph_capture_sizes=list(runner.dispatcher.sizes) if runner.dispatcher is not None else [],
        prefix_caching=llm.prefix_caching,
    )


def _summarize(value: Any) -> str:
    """A one-line description of a metadata field: small tensors and lists show their values."""
    if isinstance(value, torch.Tensor):
        head = f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return f"{head} {value.tolist()}" if value.numel() <= 16 else head
    if type(value).__repr__ is object.__repr__:
        return f"<{type(value).__name__}>"  # the default repr holds a memory address: not replayable
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _metadata_records(attn_metadata: dict[str, Any]) -> list[MetadataRecord]:
    """Group layer names by the metadata *object* they received (identity, not equality)."""
    by_object: dict[int, MetadataRecord] = {}
    for name, metadata in attn_metadata.items():
        if id(metadata) not in by_object:
            attrs = vars(metadata) if hasattr(metadata, "__dict__") else {"value": metadata}
            by_object[id(metadata)] = MetadataRecord(
                type_name=type(metadata).__name__,
                layer_names=[],
                fields={k: _summarize(v) for k, v in attrs.items()},
            )
        by_object[id(metadata)].layer_names.append(name)
    return list(by_object.values())


def _mla_split(attn_metadata: dict[str, Any]) -> MLASplitRecord | None:
    """The split of the first MLA metadata object of the step (every MLA attention group splits
    the same batch by the same query lengths, so they all agree)."""
    for metadata in attn_metadata.values():
        if isinstance(metadata, MLACommonMetadata):
            return MLASplitRecord(metadata.num_decodes, metadata.num_decode_tokens, metadata.num_prefills,
                                  metadata.num_prefill_tokens)
    return None


def _runs(ids: list[int]) -> list[list[int]]:
    """[3, 7, 8, 9, 4] -> [[3, 3], [7, 9], [4, 4]]: runs of consecutive ids, order kept."""
    runs: list[list[int]] = []
    for block_id in ids:
        if runs and runs[-1][1] + 1 == block_id:
            runs[-1][1] = block_id
        else:
            runs.append([block_id, block_id])
    return runs


def block_pool_record(pool: BlockPool) -> BlockPoolRecord:
    """A pool's ref counts, short hashes and free queue, as plain data."""
    return BlockPoolRecord(
        num_blocks=pool.num_blocks,
        held=[[b.block_id, b.ref_cnt] for b in pool.blocks if b.ref_cnt],
        cached=[[block.block_id, block_hash.hex()[:SHORT_HASH_CHARS]]
                for block_hash, block in pool.cached_block_hash_to_block.items()],
        free_queue=_runs(list(pool.free_queue)),
    )


def step_record(event: StepEvent, llm: LLM, duration_s: float) -> StepRecord:
    """Turn a `StepEvent` into plain data.

    The event arrives after `Scheduler.update` has advanced the requests; the
    `ScheduledRequest`s keep what the step itself saw (computed tokens, decode or prefill).
    """
    sched, result = event.scheduler_output, event.result
    requests = []
    for s in sched.scheduled:
        req = s.request
        requests.append(RequestRecord(
            req.request_id, "decode" if s.is_decode else "prefill", s.num_computed_tokens, s.num_new_tokens,
            req.num_prompt_tokens, event.block_ids[req.request_id], s.num_cached_tokens,
        ))
    manager = llm.kv_cache_manager
    for req in llm.scheduler.running:
        if req.request_id not in event.block_ids:
            requests.append(RequestRecord(
                req.request_id, "unscheduled", req.num_computed_tokens, 0, req.num_prompt_tokens,
                manager.get_block_ids(req.request_id),
            ))
    in_use = [
        len({b for r in requests for b in r.block_ids[g] if b != 0})
        for g in range(len(event.num_free_blocks))
    ]
    batch = result.batch
    n = batch.num_tokens  # the step's own tokens; a graph's padding rows follow them
    return StepRecord(
        step=event.step,
        requests=requests,
        input_ids=batch.input_ids[:n].tolist(),
        positions=batch.positions[:n].tolist(),
        slot_mappings=[s[:n].tolist() for s in batch.slot_mappings],
        num_blocks_in_use=in_use,
        num_free_blocks=list(event.num_free_blocks),
        preempted_req_ids=list(sched.preempted_req_ids),
        finished_req_ids=list(event.finished_req_ids),
        metadata=_metadata_records(result.attn_metadata),
        attn_metadata_keys=list(result.attn_metadata),
        slot_mapping_keys=list(result.slot_mapping),
        cudagraph_mode=result.cudagraph_mode.name,
        batch_descriptor=dataclasses.asdict(result.batch_descriptor),
        duration_s=duration_s,
        mla_split=_mla_split(result.attn_metadata),
        # The listener runs after Scheduler.update: finished requests' blocks are back in the queue.
        block_pools=[block_pool_record(pool) for pool in manager.block_pools],
    )
