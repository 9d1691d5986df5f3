"""`StepTrace`: a recording of what the engine did in each step, as plain data.

    trace = StepTrace.attach(llm)          # listens to every llm.step() from now on
    llm.generate(prompts, params)
    trace.detach()
    trace[0].requests, trace[0].slot_mappings, trace.engine.attention_groups
    trace[0].mla_split                     # MLA models: which tokens went to forward_mqa / forward_mha
    trace[0].block_pools[0].free_queue     # each group's pool after the step: ref counts, hashes, eviction order
    trace.save("run.json"); StepTrace.load("run.json")   # replay a GPU run on a laptop

No record holds a tensor or a reference into the engine (only a live StepTrace keeps the LLM it
listens to): every record is ints, strings and lists, so a trace survives JSON and a view draws
a replayed step exactly as it drew it live. When no trace is attached, the engine does not even
build its `StepEvent`.

Modules: records.py (the plain-data records), recorder.py (engine objects -> records; not CUDA
graph capture), step_trace.py (StepTrace: attach, index, save / load).
"""

from pagedkv.trace.recorder import block_pool_record, engine_info, step_record
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
from pagedkv.trace.step_trace import TRACE_FORMAT, TRACE_VERSION, StepTrace

__all__ = [
    "SHORT_HASH_CHARS",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "AttentionGroupInfo",
    "BlockPoolRecord",
    "EngineInfo",
    "KVCacheGroupInfo",
    "KVSpecInfo",
    "MLASplitRecord",
    "MetadataRecord",
    "RequestRecord",
    "StepRecord",
    "StepTrace",
    "block_pool_record",
    "engine_info",
    "step_record",
]
