"""pagedkv: a readable re-implementation of a paged-KV LLM server's attention stack.

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="tiny")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
"""

from pagedkv.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedkv.engine.llm import LLM, EngineStats, StepEvent
from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "CompilationConfig",
    "CompletionOutput",
    "CUDAGraphMode",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StepEvent",
]
