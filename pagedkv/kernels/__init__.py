"""Triton kernels: the KV cache scatter and paged attention.

`HAS_TRITON` says whether they can be used; without Triton the names exist but raise a clear
error when called, so `import pagedkv` works everywhere.

Without a GPU, Triton can only run kernels through its interpreter (numpy on the CPU), and it
decides interpreted-or-compiled when `triton` is first imported. So on a machine with no CUDA
device, if nothing has imported triton yet, `TRITON_INTERPRET=1` is set first (unless set).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pagedkv.kernels.attention_config import KernelConfig
    from pagedkv.kernels.reshape_and_cache import reshape_and_cache
    from pagedkv.kernels.split_kv import SplitKVWorkspace
    from pagedkv.kernels.unified_attention import unified_attention
else:  # pragma: no cover

    def _missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("pagedkv.kernels needs the `triton` package (pip install triton)")

    reshape_and_cache = unified_attention = _missing  # type: ignore[assignment]
    KernelConfig = SplitKVWorkspace = None  # type: ignore[assignment,misc]

__all__ = ["HAS_TRITON", "KernelConfig", "SplitKVWorkspace", "reshape_and_cache", "unified_attention"]
