"""The recorder: engine objects (the `LLM`, a `StepEvent`, a `BlockPool`) turned into trace records."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.attention.mla.common import MLACommonMetadata
from pagedkv.trace.records import (
    SHORT_HASH_CHARS,
    AttentionGroupInfo,
    BlockPoolRecord,
    EngineInfo,
    KVCacheGroupInfo,
    KVSpecInfo,
    MetadataRecord,
    MLASplitRecord,
    RequestRecord,
    StepRecord,
)

if TYPE_CHECKING:
    from pagedkv.engine.events import StepEvent
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.scheduler import ScheduledRequest
    from pagedkv.kv_cache.block_pool import BlockPool
    from pagedkv.kv_cache.spec import KVCacheSpec


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
    # mypy reads type(value).__repr__ as a method bound to nothing and calls the identity impossible.
    if type(value).__repr__ is object.__repr__:  # type: ignore[comparison-overlap]
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
            return MLASplitRecord(
                num_decodes=metadata.num_decodes,
                num_decode_tokens=metadata.num_decode_tokens,
                num_prefills=metadata.num_prefills,
                num_prefill_tokens=metadata.num_prefill_tokens,
            )
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
        cached=[
            [block.block_id, block_hash.hex()[:SHORT_HASH_CHARS]]
            for block_hash, block in pool.cached_block_hash_to_block.items()
        ],
        free_queue=_runs(list(pool.free_queue)),
    )


def _request_record(s: ScheduledRequest, block_ids: list[list[int]]) -> RequestRecord:
    """A scheduled request's part of the step; with drafts, what verifying them did."""
    req, drafts = s.request, list(s.draft_token_ids)
    emitted: list[int] = []
    if drafts and s.num_accepted_tokens is not None:
        # After Scheduler.update the output holds this step's tokens at the positions after the
        # known token (speculation runs without async scheduling: no placeholders).
        first = s.num_computed_tokens + 1
        emitted = req.token_ids_between(first, first + s.num_accepted_tokens + 1)
    return RequestRecord(
        req.request_id,
        "decode" if s.is_decode else "prefill",  # a request with drafts is a decode too
        s.num_computed_tokens,
        s.num_new_tokens,
        req.num_prompt_tokens,
        block_ids,
        s.num_cached_tokens,
        draft_token_ids=drafts,
        num_accepted_tokens=s.num_accepted_tokens,
        rolled_back_block_ids=[list(ids) for ids in s.rolled_back_block_ids],
        emitted_token_ids=emitted,
    )


def step_record(event: StepEvent, llm: LLM, duration_s: float) -> StepRecord:
    """Turn a `StepEvent` into plain data.

    The event arrives after `Scheduler.update` has advanced the requests; the
    `ScheduledRequest`s keep what the step itself saw (computed tokens, decode or prefill).
    """
    sched, result = event.scheduler_output, event.result
    requests = [_request_record(s, event.block_ids[s.request.request_id]) for s in sched.scheduled]
    manager = llm.kv_cache_manager
    for req in llm.scheduler.running:
        if req.request_id not in event.block_ids:
            requests.append(
                RequestRecord(
                    req.request_id,
                    "unscheduled",
                    req.num_computed_tokens,
                    0,
                    req.num_prompt_tokens,
                    manager.get_block_ids(req.request_id),
                )
            )
    in_use = [len({b for r in requests for b in r.block_ids[g] if b != 0}) for g in range(len(event.num_free_blocks))]
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
