"""pagedkv: a readable re-implementation of a paged-KV LLM server's attention stack.

from pagedkv import LLM, SamplingParams
llm = LLM(model="tiny")
print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
"""

import sys as _sys
from importlib.abc import MetaPathFinder as _MetaPathFinder
from importlib.machinery import ModuleSpec as _ModuleSpec
from importlib.util import spec_from_file_location as _spec_from_file_location
from pathlib import Path as _Path


class _CloneWidgetsFinder(_MetaPathFinder):
    """Finds `pagedkv.widgets` in a clone run without installing (PYTHONPATH=<clone>).

    The views' source is the repository's top-level `widgets/` folder; pyproject.toml's package-dir
    maps it to `pagedkv.widgets` in a wheel and an editable install. This finder gives a bare clone
    the same one mapping, and nothing else of the repository (tests/, benchmarks/) becomes a
    pagedkv subpackage.
    """

    def __init__(self, folder: _Path) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> _ModuleSpec | None:
        if fullname != "pagedkv.widgets":
            return None
        return _spec_from_file_location(
            fullname, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


_clone_widgets = _Path(__file__).resolve().parent.parent / "widgets"
if not (_Path(__file__).parent / "widgets").is_dir() and (_clone_widgets / "__init__.py").is_file():
    _sys.meta_path.insert(0, _CloneWidgetsFinder(_clone_widgets))  # before an editable install's finder

from pagedkv.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.engine.events import EngineStats, StepEvent
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
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
