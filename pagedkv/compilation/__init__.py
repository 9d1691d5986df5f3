"""CUDA graph modes and piecewise torch.compile.

    modes.py     CUDAGraphMode: (decode routine, mixed routine) pairs       (a leaf: no pagedkv imports)
    resolve.py   resolve_cudagraph_mode: lower a mode to the backends' AttentionCGSupport
    split.py     split_graph: cut a Dynamo graph at the attention custom ops
    backend.py   PiecewiseBackend: the torch.compile backend; PieceWrapper, the CUDA graph hook
    wrapper.py   compile_model: trace the whole forward once, token dimension dynamic
    cache.py     the on-disk compile cache ($PAGEDKV_CACHE_DIR), and whether a compile found it warm

Layering: worker > compilation > attention > config. `pagedkv.config` imports
`CUDAGraphMode` from the leaf `modes.py`; the other modules import `pagedkv.config` or
the attention layer, so they are loaded lazily (on first attribute access): importing
`pagedkv.config` first must not come back round to it.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedkv.compilation.modes import CUDAGraphMode

_LAZY = {
    "resolve_cudagraph_mode": "pagedkv.compilation.resolve",
    "split_graph": "pagedkv.compilation.split",
    "SplitItem": "pagedkv.compilation.split",
    "CompiledPiece": "pagedkv.compilation.backend",
    "PiecewiseBackend": "pagedkv.compilation.backend",
    "PieceWrapper": "pagedkv.compilation.backend",
    "CompiledForward": "pagedkv.compilation.wrapper",
    "attention_compiled_piecewise": "pagedkv.compilation.wrapper",
    "compile_model": "pagedkv.compilation.wrapper",
}

__all__ = ["CUDAGraphMode", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pagedkv.compilation' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
