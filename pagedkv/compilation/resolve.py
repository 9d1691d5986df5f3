"""Lowering the configured `CUDAGraphMode` to what the attention backends allow.

The runner asks every attention group's metadata builder how much capture it allows
(`AttentionCGSupport`, NEVER < UNIFORM_SINGLE_TOKEN_DECODE < UNIFORM_BATCH < ALWAYS) and
keeps the weakest answer. `resolve_explained` then applies these rules, in order:

    1. enforce_eager                                          -> NONE
    2. mixed routine FULL, support below ALWAYS:  NEVER raises; else FULL_AND_PIECEWISE if
                                                  attention is compiled piecewise, else
                                                  FULL_DECODE_ONLY
    3. decode routine FULL, support NEVER                     -> PIECEWISE or NONE (same test)
    4. decode routine FULL, decode query length > 1, support
       below UNIFORM_BATCH                                    -> PIECEWISE or NONE (same test)
    5. a piecewise routine, attention not compiled piecewise  -> that routine run eagerly
    6. a FULL routine left with support NEVER raises (a last guard: rules 2-3 leave none)

and records each change as a `LoweringStep`. `resolve_cudagraph_mode`, what the engine calls,
logs every step as a warning and raises the error. Every warning reads "CUDAGraphMode.X is
not supported with ...; setting cudagraph_mode=Y (why)", as vLLM's do (vllm/config/compilation.py,
vllm/v1/worker/gpu_model_runner.py), so grepping a log for "is not supported with" finds every
change of mode, and the ones a backend forced name it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.config import CUDAGraphMode

logger = logging.getLogger("pagedkv")


@dataclass(frozen=True)
class LoweringStep:
    """One change of mode: the rule that made it, what it was made by, and why."""

    rule: int
    before: CUDAGraphMode
    after: CUDAGraphMode
    cause: str
    """What `before` is not supported with: the backend and its support, enforce_eager, or the split."""
    reason: str

    @property
    def message(self) -> str:
        """The warning the engine logs for this step."""
        return (
            f"CUDAGraphMode.{self.before.name} is not supported with {self.cause}; "
            f"setting cudagraph_mode={self.after.name} ({self.reason})"
        )


@dataclass(frozen=True)
class Resolution:
    """What the lowering rules made of one configuration, step by step."""

    configured: CUDAGraphMode
    resolved: CUDAGraphMode | None
    """None when the configuration is refused."""
    steps: tuple[LoweringStep, ...]
    """One per change of mode, in the order the rules made them."""
    error: str | None
    """Why the configuration is refused (the ValueError `resolve_cudagraph_mode` raises)."""

    @property
    def warnings(self) -> tuple[str, ...]:
        """The warnings `resolve_cudagraph_mode` logs, in order."""
        return tuple(step.message for step in self.steps)

    def describe(self) -> str:
        """The resolved mode, or the error, and the path through the rules as logged."""
        outcome = f"raises ValueError: {self.error}" if self.resolved is None else f"resolves to {self.resolved.name}"
        log = "".join(f"\n  log: {message}" for message in self.warnings)
        if not log and not self.error:
            log = "\n  (no warning: the mode is unchanged)"
        return f"{self.configured.name} {outcome}{log}"


def resolve_explained(
    mode: CUDAGraphMode | str,
    support: AttentionCGSupport,
    *,
    backend_name: str,
    attention_compiled_piecewise: bool,
    uniform_decode_query_len: int = 1,
    enforce_eager: bool = False,
) -> Resolution:
    """The lowering rules applied to one configuration: every step, and the mode or the error.

    Logs nothing (notebook widgets call it on every click); `resolve_cudagraph_mode` is the
    engine's call.

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
        TypeError, ValueError: an argument is malformed (a refused configuration is no
            exception here: it is `Resolution.error`).
    """
    configured = CUDAGraphMode.parse(mode)
    current = configured  # lowered by the rules below, one step at a time
    _check_arguments(support, backend_name, uniform_decode_query_len)
    steps: list[LoweringStep] = []
    by_backend = f"{backend_name} backend (support: {support.name})"

    def lower(rule: int, new: CUDAGraphMode, cause: str, reason: str) -> CUDAGraphMode:
        steps.append(LoweringStep(rule, current, new, cause, reason))
        return new

    def refused() -> Resolution:
        error = f"CUDAGraphMode.{current.name} is not supported with {by_backend}; please try cudagraph_mode=PIECEWISE"
        return Resolution(configured, None, tuple(steps), error)

    if enforce_eager:
        if current is not CUDAGraphMode.NONE:
            lower(1, CUDAGraphMode.NONE, "enforce_eager=True", "every step runs eagerly")
        return Resolution(configured, CUDAGraphMode.NONE, tuple(steps), None)
    split = "attention is compiled piecewise" if attention_compiled_piecewise else "attention is not compiled piecewise"
    if current.mixed_mode() is CUDAGraphMode.FULL and support is not AttentionCGSupport.ALWAYS:
        if support is AttentionCGSupport.NEVER:
            return refused()
        fallback = CUDAGraphMode.FULL_AND_PIECEWISE if attention_compiled_piecewise else CUDAGraphMode.FULL_DECODE_ONLY
        current = lower(2, fallback, by_backend, f"full graphs of mixed batches need support ALWAYS; {split}")
    if current.decode_mode() is CUDAGraphMode.FULL and support is AttentionCGSupport.NEVER:
        current = lower(
            3, _piecewise_or_none(attention_compiled_piecewise), by_backend, f"no full graphs at all; {split}"
        )
    if (
        current.decode_mode() is CUDAGraphMode.FULL
        and uniform_decode_query_len > 1
        and support.value < AttentionCGSupport.UNIFORM_BATCH.value
    ):
        current = lower(
            4,
            _piecewise_or_none(attention_compiled_piecewise),
            by_backend,
            f"decode steps of {uniform_decode_query_len} query tokens need support UNIFORM_BATCH; {split}",
        )
    if current.requires_piecewise_compilation() and not attention_compiled_piecewise:
        current = lower(
            5,
            current.without_piecewise(),
            "a model not split at the attention ops",
            "piecewise graphs need the attention ops split out, as compile=True does",
        )
    if current.has_full_cudagraphs() and support is AttentionCGSupport.NEVER:
        return refused()
    return Resolution(configured, current, tuple(steps), None)


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

    Takes `resolve_explained`'s arguments (the same list, written out so callers see it;
    tests/compilation/test_cudagraph_mode.py checks the two signatures stay equal), logs each
    of its steps as a warning and returns its mode.

    Raises:
        ValueError: full graphs were asked for every batch (FULL) with a backend that cannot
            capture any, or an argument is malformed.
    """
    result = resolve_explained(
        mode,
        support,
        backend_name=backend_name,
        attention_compiled_piecewise=attention_compiled_piecewise,
        uniform_decode_query_len=uniform_decode_query_len,
        enforce_eager=enforce_eager,
    )
    for step in result.steps:
        logger.warning("%s", step.message)
    if result.resolved is None:
        raise ValueError(result.error)
    return result.resolved


def _piecewise_or_none(attention_compiled_piecewise: bool) -> CUDAGraphMode:
    return CUDAGraphMode.PIECEWISE if attention_compiled_piecewise else CUDAGraphMode.NONE


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
