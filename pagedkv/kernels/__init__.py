"""Triton kernels: the KV cache scatter, paged attention and MLA decode attention.

`HAS_TRITON` says whether they can be used; without Triton the names exist but raise a clear
error when called, so `import pagedkv` works everywhere.

Without a GPU, Triton runs kernels only through its interpreter (numpy on the CPU), and only if
`TRITON_INTERPRET=1` was in the environment when `triton` was first imported. Importing this
package does not set it (that would change the process's environment behind the user's back):
`interpreter_problem()` says whether the interpreter is on, and what to do when it is not. Nor
does importing it import Triton: each name below loads its module on first use, so the plain-torch
modules here (`batch_invariant`, which the models import) leave the interpreter's switch open.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None

_MODULES = {
    "KernelConfig": "attention_config",
    "interpreter_problem": "common",
    "MLADecodeWorkspace": "mla_decode",
    "mla_decode_attention": "mla_decode",
    "reshape_and_cache": "reshape_and_cache",
    "SplitKVWorkspace": "split_kv",
    "unified_attention": "unified_attention",
}
"""Name -> the module (of this package) that defines it, imported on first use."""


def _missing(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover
    raise ImportError("pagedkv.kernels needs the `triton` package (pip install triton)")


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not HAS_TRITON:  # pragma: no cover
        return None if name[0].isupper() else _missing
    value = getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = ["HAS_TRITON", *_MODULES]
