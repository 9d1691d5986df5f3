"""pagedkv: a readable re-implementation of a paged-KV LLM server's attention stack.

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="tiny")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
"""

from pathlib import Path as _Path

# A clone used without installing it (PYTHONPATH=<clone>) or installed editable: `pagedkv.widgets`
# and the workbook's data live in the repository's top level (widgets/, notebooks/), which an
# installed wheel has inside the package (pyproject.toml maps them). Searching the repository
# root for pagedkv's subpackages too makes `import pagedkv.widgets` work the same way in a clone.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "widgets" / "__init__.py").is_file():
    __path__.append(str(_root))

from pagedkv.config import (  # noqa: E402
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedkv.engine.events import EngineStats, StepEvent  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams  # noqa: E402

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
