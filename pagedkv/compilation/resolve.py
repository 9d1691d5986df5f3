"""Lowering the configured `CUDAGraphMode` to what the attention backends allow.

The runner asks every attention group's metadata builder how much capture it allows
(`AttentionCGSupport`, NEVER < UNIFORM_SINGLE_TOKEN_DECODE < UNIFORM_BATCH < ALWAYS) and
keeps the weakest answer. `resolve_cudagraph_mode` then applies these rules, in order:

    1. enforce_eager                                          -> NONE
    2. mixed routine FULL, support below ALWAYS:  NEVER raises; else FULL_AND_PIECEWISE if
                                                  attention is compiled piecewise, else
                                                  FULL_DECODE_ONLY
    3. decode routine FULL, support NEVER                     -> PIECEWISE or NONE (same test)
    4. decode routine FULL, decode query length > 1, support
       below UNIFORM_BATCH                                    -> PIECEWISE or NONE (same test)
    5. a piecewise routine, attention not compiled piecewise  -> that routine run eagerly
    6. a FULL routine left with support NEVER raises (a last guard: rules 2-3 leave none)

Every change logs a warning that names the backend, so a slower-than-expected start-up
can be traced to the backend that forced it.
"""

from __future__ import annotations

import logging

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.config import CUDAGraphMode

logger = logging.getLogger("pagedkv")


def resolve_cudagraph_mode(
    mode: CUDAGraphMode | str,
    support: AttentionCGSupport,
    *,
    backend_name: str,
    attention_compiled_piecewise: bool,
    uniform_decode_query_len: int = 1,
    enforce_eager: bool = False,
) -> CUDAGraphMode:
    """The mode the engine can really run, given the weakest backend's support.

    Args:
        mode: the configured mode (or its name).
        support: the weakest `AttentionCGSupport` over all attention groups.
        backend_name: the backend that has that support (named in warnings and errors).
        attention_compiled_piecewise: the model is compiled with the attention ops split out,
            so piecewise graphs exist (`pagedkv.compilation.attention_compiled_piecewise`).
        uniform_decode_query_len: query tokens per request in a decode step (1 + speculative
            tokens).
        enforce_eager: run every step eagerly.

    Raises:
        ValueError: full graphs were asked for every batch (FULL) with a backend that cannot
            capture any, or an argument is malformed.
    """
    mode = CUDAGraphMode.parse(mode)
    _check_arguments(support, backend_name, uniform_decode_query_len)

    def lower(new: CUDAGraphMode, reason: str) -> CUDAGraphMode:
        logger.warning(
            "cudagraph_mode %s -> %s with the %s backend (support: %s): %s.",
            mode.name, new.name, backend_name, support.name, reason,
        )
        return new

    if enforce_eager:
        return mode if mode is CUDAGraphMode.NONE else lower(CUDAGraphMode.NONE, "enforce_eager=True")
    split = "attention is compiled piecewise" if attention_compiled_piecewise else "attention is not compiled piecewise"
    if mode.mixed_mode() is CUDAGraphMode.FULL and support is not AttentionCGSupport.ALWAYS:
        if support is AttentionCGSupport.NEVER:
            raise ValueError(_unsupported(mode, backend_name, support))
        fallback = CUDAGraphMode.FULL_AND_PIECEWISE if attention_compiled_piecewise else CUDAGraphMode.FULL_DECODE_ONLY
        mode = lower(fallback, f"full graphs of mixed batches need support ALWAYS; {split}")
    if mode.decode_mode() is CUDAGraphMode.FULL and support is AttentionCGSupport.NEVER:
        mode = lower(_piecewise_or_none(attention_compiled_piecewise), f"no full graphs at all; {split}")
    if (
        mode.decode_mode() is CUDAGraphMode.FULL
        and uniform_decode_query_len > 1
        and support.value < AttentionCGSupport.UNIFORM_BATCH.value
    ):
        mode = lower(
            _piecewise_or_none(attention_compiled_piecewise),
            f"decode steps of {uniform_decode_query_len} query tokens need support UNIFORM_BATCH; {split}",
        )
    if mode.requires_piecewise_compilation() and not attention_compiled_piecewise:
        mode = lower(mode.without_piecewise(), "piecewise graphs need the attention ops split out (compile=True)")
    if mode.has_full_cudagraphs() and support is AttentionCGSupport.NEVER:
        raise ValueError(_unsupported(mode, backend_name, support))
    return mode


def _piecewise_or_none(attention_compiled_piecewise: bool) -> CUDAGraphMode:
    return CUDAGraphMode.PIECEWISE if attention_compiled_piecewise else CUDAGraphMode.NONE


def _unsupported(mode: CUDAGraphMode, backend_name: str, support: AttentionCGSupport) -> str:
    return (
        f"CUDAGraphMode.{mode.name} is not supported with {backend_name} backend (support: {support.name}); "
        "please try cudagraph_mode=PIECEWISE"
    )


def _check_arguments(support: AttentionCGSupport, backend_name: str, uniform_decode_query_len: int) -> None:
    if not isinstance(support, AttentionCGSupport):
        raise TypeError(f"support must be an AttentionCGSupport, got {support!r}.")
    if not isinstance(backend_name, str) or not backend_name:
        raise TypeError(f"backend_name must be a non-empty str (the backend named in messages), got {backend_name!r}.")
    if isinstance(uniform_decode_query_len, bool) or not isinstance(uniform_decode_query_len, int):
        raise TypeError(f"uniform_decode_query_len must be an int, got {uniform_decode_query_len!r}.")
    if uniform_decode_query_len < 1:
        raise ValueError(
            f"uniform_decode_query_len must be >= 1 (1 + speculative tokens), got {uniform_decode_query_len}."
        )
