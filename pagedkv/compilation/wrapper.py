"""`compile_model`: trace a model's forward once, for every layer and every batch size.

    runner.model(input_ids, positions)
      -> CompiledForward: the first call with >= 2 tokens marks dim 0 of both inputs
                          dynamic and lets Dynamo trace the *whole* forward into one graph
      -> PiecewiseBackend: split at the attention ops, compile the pieces (backend.py)
      -> later calls: Dynamo's guards pass for any token count -> the same compiled code

Why one graph serves all layers: Dynamo unrolls the loop over the decoder layers inside
one trace, and each attention op gets its layer name as a string *constant* of its node.
Nothing is compiled per layer, so a layer never forces a recompile; and since the names
sit in the op nodes (split out), the pieces between the ops are the same graph for every
layer, compiled once. Compiling each decoder layer separately instead would make Dynamo
guard on each layer's name and compile one graph per layer.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedkv.compilation.backend import PIECE_COMPILERS, PiecewiseBackend, PieceWrapper
from pagedkv.compilation.cache import CacheReport, cache_report, enable_compile_cache
from pagedkv.compilation.split import resolve_splitting_ops
from pagedkv.config import ATTENTION_OPS, CompilationConfig, EngineConfig

logger = logging.getLogger("pagedkv")


def attention_compiled_piecewise(config: CompilationConfig) -> bool:
    """The model is compiled with both attention ops split out, so piecewise graphs exist.

    Both: the cache-update op reads the step's slot mapping by layer name, which a graph
    captured around it would freeze.
    """
    # ATTENTION_OPS is named in config (the lowest layer), where the default splitting_ops reads it too.
    return config.compile and all(op in config.splitting_ops for op in ATTENTION_OPS)


class CompiledForward:
    """Stands in for `model.forward`: the compiled forward, traced on first use."""

    def __init__(self, model: nn.Module, backend: PiecewiseBackend, cache_dir: Path | None = None) -> None:
        self.backend = backend
        self.cache_dir = cache_dir
        """Inductor's cache directory (None: the pieces are not compiled by Inductor)."""
        forward = type(model).forward
        self.eager_forward = types.MethodType(forward, model)
        # Dynamo keeps compiled code on the function's code object, shared by every instance
        # of the class: several engines in one process would pile up entries on it and hit
        # the recompile limit. A private copy of the code gives this model its own cache.
        private = types.FunctionType(
            forward.__code__.replace(), forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
        )
        self.compiled = torch.compile(
            types.MethodType(private, model),
            backend=backend,
            fullgraph=True,  # a graph break would cut the model into several Dynamo graphs
            options={"guard_filter_fn": _drop_shape_guards},
        )
        self.traced = False
        self.compile_seconds: float | None = None
        """Wall time of the trace and the pieces' compilation (the first call that traced)."""
        self.cache: CacheReport | None = None
        """How that compilation used the on-disk compile cache (`pagedkv.compilation.cache`)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.traced:
            if input_ids.shape[0] < 2:
                # Dynamo would specialise a dimension of size 1: trace at the first batch of >= 2 tokens.
                return self.eager_forward(input_ids, positions)
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            start = time.perf_counter()
            with cache_report(self.cache_dir) as self.cache:
                hidden = self.compiled(input_ids, positions)
            self.compile_seconds = time.perf_counter() - start
            self.traced = True
            logger.info(
                "torch.compile: traced and compiled in %.1f s, %s.", self.compile_seconds, self.cache.describe()
            )
            return hidden
        return self.compiled(input_ids, positions)


def _drop_shape_guards(guards: Sequence[Any]) -> list[bool]:
    """Keep every guard except the symbolic-shape ones.

    A dynamic dimension is traced assuming it is at least 2 ("0/1 specialisation"), and the
    shape guard would send a 1-token batch back to Dynamo for a second graph. The pieces
    are valid for any token count, so that guard (and `positions` having as many rows as
    `input_ids`, which the runner ensures) is dropped; the rest (grad mode, dtypes, module
    attributes) still recompile when they change.
    """
    return [guard.guard_type != "SHAPE_ENV" for guard in guards]


def compile_model(model: nn.Module, config: EngineConfig, wrap_piece: PieceWrapper | None = None) -> CompiledForward:
    """Make `model(input_ids, positions)` run the piecewise-compiled forward.

    `model.forward` is replaced on this instance only (the runner keeps calling `model(...)`).
    Tracing happens on the first call with at least 2 tokens, inside a forward context.
    `wrap_piece` receives every compiled piece (the hook for piecewise CUDA graphs). Inductor's
    pieces are cached on disk (`pagedkv.compilation.cache`), so another process starts warm.
    """
    compilation = config.compilation_config
    piece_compiler = compilation.piece_compiler
    if piece_compiler is None:
        piece_compiler = "inductor" if config.device.type == "cuda" else "eager"
    if piece_compiler not in PIECE_COMPILERS:
        raise ValueError(
            f"CompilationConfig.piece_compiler must be one of {PIECE_COMPILERS} or None "
            f"(inductor on CUDA, eager elsewhere), got {piece_compiler!r}."
        )
    backend = PiecewiseBackend(resolve_splitting_ops(compilation.splitting_ops), piece_compiler, wrap_piece)
    cache_dir = enable_compile_cache() if piece_compiler == "inductor" else None
    compiled = CompiledForward(model, backend, cache_dir)
    model.forward = compiled  # an instance attribute: nn.Module.__call__ finds it first
    return compiled
