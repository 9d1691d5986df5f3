"""Checkers for notebook 08 (CUDA graphs and torch.compile): one exercise per lowering rule.

Every answer is checked against `resolve_cudagraph_mode` itself, run on the exercise's
configuration while its log warnings are captured (`resolve_explained`), so a wrong answer
is shown the resolver's own path through the rules next to the rule the exercise is about.
The notebook's `CudaGraphModeExplorer` widget uses the same `resolve_explained`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.compilation import CUDAGraphMode, resolve_cudagraph_mode
from pagedkv.exercises import CheckResult

RAISES = "ValueError"
"""How an answer says "the resolver raises" (the class `ValueError` is accepted too)."""

RULES: dict[int, str] = {
    1: "enforce_eager=True beats everything, an error included: every step runs eagerly (NONE).",
    2: "A FULL graph of a *mixed* batch captures attention over prefills and decodes of any lengths, "
       "which only support ALWAYS allows. Below ALWAYS, decode batches keep their FULL graph and mixed "
       "batches fall back to piecewise graphs if attention is compiled piecewise (FULL_AND_PIECEWISE), "
       "else to eager (FULL_DECODE_ONLY). With support NEVER no FULL graph is left to keep: it raises.",
    3: "Support NEVER allows no FULL graph at all, so the FULL decode routine goes too. What is left is "
       "PIECEWISE if attention is compiled piecewise, else NONE, for decode and mixed batches alike.",
    4: "Decode steps of more than 1 query token per request (speculative decoding) are uniform batches, "
       "not single-token ones: a FULL decode graph needs support UNIFORM_BATCH. Below it the mode becomes "
       "PIECEWISE if attention is compiled piecewise, else NONE.",
    5: "Piecewise graphs exist only when the model is compiled with both attention ops split out "
       "(compile=True). Without that, a piecewise routine runs eagerly: PIECEWISE -> NONE, "
       "FULL_AND_PIECEWISE -> FULL_DECODE_ONLY.",
    6: "The last guard raises when a FULL routine survives with support NEVER. Rules 2 and 3 have "
       "already removed every such routine except FULL on mixed batches, which rule 2 refuses first.",
}
"""The lowering rules in the order `resolve_cudagraph_mode` applies them."""


@dataclass(frozen=True)
class Resolution:
    """What `resolve_cudagraph_mode` made of one configuration, and what it logged."""

    configured: CUDAGraphMode
    resolved: CUDAGraphMode | None
    """None when it raised."""
    warnings: tuple[str, ...]
    """The warnings it logged, in order: one per change of mode."""
    error: str | None
    """The ValueError's message when it raised."""

    def describe(self) -> str:
        """The resolved mode, or the error, and the path through the rules as logged."""
        outcome = f"raises ValueError: {self.error}" if self.error else f"resolves to {self.resolved.name}"
        log = "".join(f"\n  log: {message}" for message in self.warnings)
        if not log and not self.error:
            log = "\n  (no warning: the mode is unchanged)"
        return f"{self.configured.name} {outcome}{log}"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured_warnings(logger: logging.Logger) -> Iterator[list[str]]:
    """Collect the logger's warnings while inside, instead of printing them: the caller shows
    them (a widget redrawn on every click would otherwise print each one again)."""
    handler = _Collect()
    level, propagate = logger.level, logger.propagate
    if not logger.isEnabledFor(logging.WARNING):
        logger.setLevel(logging.WARNING)  # someone silenced it: the messages are what we are after
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def resolve_explained(
    mode: CUDAGraphMode | str,
    support: AttentionCGSupport,
    *,
    backend_name: str,
    attention_compiled_piecewise: bool,
    uniform_decode_query_len: int = 1,
    enforce_eager: bool = False,
) -> Resolution:
    """Run `resolve_cudagraph_mode` with these arguments and keep its result, warnings and error.

    Malformed arguments still raise (TypeError / ValueError from the resolver's checks);
    only the documented "not supported" ValueError becomes `Resolution.error`.
    """
    configured = CUDAGraphMode.parse(mode)
    with _captured_warnings(logging.getLogger("pagedkv")) as messages:
        try:
            resolved = resolve_cudagraph_mode(
                configured, support, backend_name=backend_name,
                attention_compiled_piecewise=attention_compiled_piecewise,
                uniform_decode_query_len=uniform_decode_query_len, enforce_eager=enforce_eager,
            )
        except ValueError as exc:
            if "is not supported with" not in str(exc):
                raise
            return Resolution(configured, None, tuple(messages), str(exc))
    return Resolution(configured, resolved, tuple(messages), None)


@dataclass(frozen=True)
class LoweringExercise:
    """One configuration to resolve by hand; `rule` is the lowering rule it is about."""

    rule: int
    mode: CUDAGraphMode
    support: AttentionCGSupport
    attention_compiled_piecewise: bool
    uniform_decode_query_len: int = 1
    enforce_eager: bool = False
    backend_name: str = "MY_BACKEND"

    def resolve(self) -> Resolution:
        return resolve_explained(
            self.mode, self.support, backend_name=self.backend_name,
            attention_compiled_piecewise=self.attention_compiled_piecewise,
            uniform_decode_query_len=self.uniform_decode_query_len, enforce_eager=self.enforce_eager,
        )

    def __str__(self) -> str:
        compiled = "compiled piecewise (compile=True)" if self.attention_compiled_piecewise else "not compiled"
        return (
            f"cudagraph_mode={self.mode.name}, {self.backend_name} support {self.support.name}, model {compiled}, "
            f"{self.uniform_decode_query_len} query token(s) per request in a decode step, "
            f"enforce_eager={self.enforce_eager}"
        )


M, S = CUDAGraphMode, AttentionCGSupport
LOWERING_EXERCISES: dict[int, LoweringExercise] = {
    1: LoweringExercise(1, M.FULL, S.NEVER, False, enforce_eager=True),
    2: LoweringExercise(2, M.FULL, S.UNIFORM_BATCH, False, uniform_decode_query_len=2),
    3: LoweringExercise(3, M.FULL_AND_PIECEWISE, S.NEVER, True),
    4: LoweringExercise(4, M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, True, uniform_decode_query_len=2),
    5: LoweringExercise(5, M.FULL_AND_PIECEWISE, S.ALWAYS, False),
}
"""Exercise number -> configuration; each one triggers exactly its rule (rule 6 has its own exercise)."""
del M, S


def _parse_answer(answer: Any) -> CUDAGraphMode | str | None:
    """A mode, RAISES, or None when the answer cannot be read."""
    if answer is ValueError or (isinstance(answer, str) and answer.strip().lower() in ("valueerror", "raises")):
        return RAISES
    try:
        return CUDAGraphMode.parse(answer.strip() if isinstance(answer, str) else answer)
    except ValueError:
        return None


def _outcome(answer: CUDAGraphMode | str) -> str:
    return "raises" if answer == RAISES else f"resolves to {answer.name}"


def _routines(mode: CUDAGraphMode) -> str:
    return f"(decode {mode.decode_mode().name}, mixed {mode.mixed_mode().name})"


def check_lowering(number: int, answer: Any) -> CheckResult:
    """Is `answer` what `resolve_cudagraph_mode` makes of `LOWERING_EXERCISES[number]`?

    `answer`: a `CUDAGraphMode`, its name, or `ValueError` / "ValueError" when you think it raises.
    """
    if number not in LOWERING_EXERCISES:
        return CheckResult(False, f"There is no lowering exercise {number!r}; they are {list(LOWERING_EXERCISES)}.")
    exercise = LOWERING_EXERCISES[number]
    if answer is ...:
        return CheckResult(False, "Replace `...` with a CUDAGraphMode (or its name), or ValueError if it raises.")
    parsed = _parse_answer(answer)
    if parsed is None:
        return CheckResult(
            False, f"{answer!r} is neither a mode ({[m.name for m in CUDAGraphMode]}) nor ValueError."
        )
    result = exercise.resolve()
    expected = RAISES if result.error else result.resolved
    if parsed == expected:
        return CheckResult(True, f"Exercise {number}: {result.describe()}")
    return CheckResult(False, f"Exercise {number}: {_explain(parsed, expected, exercise)} Rule {exercise.rule}: "
                              f"{RULES[exercise.rule]} The resolver: {result.describe()}")


def _explain(answer: CUDAGraphMode | str, expected: CUDAGraphMode | str, exercise: LoweringExercise) -> str:
    """One sentence on how the answer differs from the resolver's result."""
    if RAISES in (answer, expected):
        return f"you said it {_outcome(answer)}, but it {_outcome(expected)}."
    if answer.requires_piecewise_compilation() and not exercise.attention_compiled_piecewise:
        return f"you said {answer.name}, which needs piecewise graphs, but the model is not compiled piecewise."
    if answer is exercise.mode:
        return f"you kept the configured mode {answer.name}, but the resolver lowers it."
    return f"you said {answer.name} {_routines(answer)}, the resolver says {expected.name} {_routines(expected)}."


def raising_configurations() -> set[tuple[str, str]]:
    """(mode, support) names for which the resolver raises with enforce_eager=False, whatever the
    compile setting and decode query length (1 or 2)."""
    raising = set()
    for mode, support in itertools.product(CUDAGraphMode, AttentionCGSupport):
        outcomes = {
            resolve_explained(mode, support, backend_name="MY_BACKEND", attention_compiled_piecewise=pw,
                              uniform_decode_query_len=q).error is not None
            for pw, q in itertools.product((True, False), (1, 2))
        }
        if outcomes == {True}:
            raising.add((mode.name, support.name))
    return raising


def _support(name: Any) -> AttentionCGSupport:
    """An AttentionCGSupport or its name, in any case (as CUDAGraphMode.parse reads modes)."""
    return name if isinstance(name, AttentionCGSupport) else AttentionCGSupport[name.strip().upper()]


def check_raising(answer: Iterable[tuple[Any, Any]]) -> CheckResult:
    """Exercise 6: the set of (mode, support) pairs that raise (enforce_eager=False).

    Pairs may use enums or names: {("FULL_DECODE_ONLY", "NEVER"), ...}.
    """
    if answer is ...:
        return CheckResult(False, "Replace `...` with a set of (mode, support) pairs, e.g. {(\"NONE\", \"ALWAYS\")}.")
    try:
        given = {(CUDAGraphMode.parse(m).name, _support(s).name) for m, s in answer}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        return CheckResult(False, f"Give (mode, support) pairs of names or enums; could not read {answer!r} ({exc}).")
    expected = raising_configurations()
    if given == expected:
        return CheckResult(True, f"Only {sorted(expected)} raise(s), and rule 2 is what raises. {RULES[6]}")
    extra, missing = sorted(given - expected), sorted(expected - given)
    (mode, support), says = (extra[0], "does not raise") if extra else (missing[0], "raises too")
    how = resolve_explained(mode, AttentionCGSupport[support], backend_name="MY_BACKEND",
                            attention_compiled_piecewise=True).describe()
    return CheckResult(False, f"{(mode, support)} {says}. With compile=True: {how}")
