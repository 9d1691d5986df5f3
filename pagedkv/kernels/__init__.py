"""Triton kernels: the KV cache scatter, paged attention and MLA decode attention.

`HAS_TRITON` says whether they can be used; without Triton the names exist but raise a clear
error when called, so `import pagedkv` works everywhere.

Without a GPU, Triton runs kernels only through its interpreter (numpy on the CPU), and only if
`TRITON_INTERPRET=1` was in the environment when `triton` was first imported. Importing this
package does not set it (that would change the process's environment behind the user's back):
`interpreter_problem()` says whether the interpreter is on, and what to do when it is not.
"""

from __future__ import annotations

import importlib.util
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    from pagedkv.kernels.attention_config import KernelConfig
    from pagedkv.kernels.common import interpreter_problem
    from pagedkv.kernels.mla_decode import MLADecodeWorkspace, mla_decode_attention
    from pagedkv.kernels.reshape_and_cache import reshape_and_cache
    from pagedkv.kernels.split_kv import SplitKVWorkspace
    from pagedkv.kernels.unified_attention import unified_attention
else:  # pragma: no cover

    def _missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("pagedkv.kernels needs the `triton` package (pip install triton)")

    reshape_and_cache = unified_attention = mla_decode_attention = interpreter_problem = _missing
    KernelConfig = SplitKVWorkspace = MLADecodeWorkspace = None  # type: ignore[assignment,misc]

__all__ = [
    "HAS_TRITON",
    "KernelConfig",
    "MLADecodeWorkspace",
    "SplitKVWorkspace",
    "interpreter_problem",
    "mla_decode_attention",
    "reshape_and_cache",
    "unified_attention",
]
