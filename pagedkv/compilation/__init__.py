"""Piecewise torch.compile and the lowering of CUDA graph modes.

    resolve.py   resolve_cudagraph_mode: lower a mode to the backends' AttentionCGSupport;
                 resolve_explained: the same rules, each step recorded (a Resolution)
    split.py     split_graph: cut a Dynamo graph at the attention custom ops
    backend.py   PiecewiseBackend: the torch.compile backend; PieceWrapper, the CUDA graph hook
    wrapper.py   compile_model: trace the whole forward once, token dimension dynamic
    cache.py     the on-disk compile cache ($PAGEDKV_CACHE_DIR), and whether a compile found it warm

`CUDAGraphMode` itself is configuration: it lives in `pagedkv.config`, as vLLM keeps it in
vllm/config/compilation.py. Layering: worker > compilation > attention > config.
"""

from pagedkv.compilation.backend import CompiledPiece, PiecewiseBackend, PieceWrapper
from pagedkv.compilation.resolve import LoweringStep, Resolution, resolve_cudagraph_mode, resolve_explained
from pagedkv.compilation.split import SplitItem, split_graph
from pagedkv.compilation.wrapper import CompiledForward, attention_compiled_piecewise, compile_model

__all__ = [
    "CompiledForward",
    "CompiledPiece",
    "LoweringStep",
    "PieceWrapper",
    "PiecewiseBackend",
    "Resolution",
    "SplitItem",
    "attention_compiled_piecewise",
    "compile_model",
    "resolve_cudagraph_mode",
    "resolve_explained",
    "split_graph",
]
