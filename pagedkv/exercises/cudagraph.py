"""Checkers for notebook 08 (CUDA graphs and torch.compile): one exercise per lowering rule.

    check_lowering(number, answer)   what `resolve_cudagraph_mode` makes of LOWERING_EXERCISES[number]
    check_raising(pairs)             which (mode, support) pairs make it raise

The answers are values, not functions: each is checked against the engine's own rules
(`pagedkv.compilation.resolve.resolve_explained`, which `resolve_cudagraph_mode` wraps), run on
the exercise's configuration after the answer is in. A wrong answer is told which rule it missed,
worded from the configuration and the answer (never the resolved mode); `reveal()` walks the
recorded steps rule by rule. The notebook's `CudaGraphModeExplorer` widget reads the same steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.compilation.resolve import Resolution, resolve_explained
from pagedkv.config import CUDAGraphMode
from pagedkv.exercises import CheckResult, Either, exercise, plain

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
            self.mode,
            self.support,
            backend_name=self.backend_name,
            attention_compiled_piecewise=self.attention_compiled_piecewise,
            uniform_decode_query_len=self.uniform_decode_query_len,
            enforce_eager=self.enforce_eager,
        )

    def __str__(self) -> str:
        compiled = "yes (compile=True)" if self.attention_compiled_piecewise else "no"
        return "\n".join(
            [
                f"cudagraph_mode        {self.mode.name}",
                f"builder's support     {self.support.name} (backend {self.backend_name})",
                f"compiled piecewise    {compiled}",
                f"decode query tokens   {self.uniform_decode_query_len} per request",
                f"enforce_eager         {self.enforce_eager}",
            ]
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


def parse_mode_answer(answer: Any) -> CUDAGraphMode | str | None:
    """A mode, RAISES, or None when the answer cannot be read."""
    if isinstance(answer, str):
        answer = plain(answer, "")  # a plain str: a subclass's own strip() or == takes no part
    if answer is ValueError or (isinstance(answer, str) and answer.strip().lower() in ("valueerror", "raises")):
        return RAISES
    try:
        return CUDAGraphMode.parse(answer.strip() if isinstance(answer, str) else answer)
    except ValueError:
        return None


def _why(rule: int, exercise: LoweringExercise, mode: CUDAGraphMode) -> str:
    """Why `rule` applies to `mode` in this configuration, without the mode it leads to."""
    support, q = exercise.support.name, exercise.uniform_decode_query_len
    return {
        1: "enforce_eager=True runs every step eagerly, whatever mode is asked for",
        2: (
            f"the backend (support {support}) cannot capture a mixed batch in one graph (only ALWAYS can), "
            f"so {mode.name} cannot stay {mode.name}"
        ),
        3: f"support NEVER captures no graph of attention at all, so the FULL decode routine of {mode.name} goes too",
        4: (
            f"a decode step has {q} query tokens per request: a uniform batch, not a single-token one, and "
            f"support {support} captures no FULL graph of it (that takes UNIFORM_BATCH)"
        ),
        5: (
            f"{mode.name} has a piecewise routine, and piecewise graphs need the model compiled with attention "
            "split out (compile=True), which it is not"
        ),
    }[rule]


def _broken_rule(answer: CUDAGraphMode, exercise: LoweringExercise) -> tuple[int, str] | None:
    """The first rule a resolved mode cannot break and `answer` breaks, with why; None if it breaks none."""
    support = exercise.support
    if exercise.enforce_eager and answer is not CUDAGraphMode.NONE:
        return 1, f"{_why(1, exercise, answer)}, so no graph of any kind is left"
    if answer.mixed_mode() is CUDAGraphMode.FULL and support is not AttentionCGSupport.ALWAYS:
        return 2, _why(2, exercise, answer)
    if answer.decode_mode() is CUDAGraphMode.FULL and support is AttentionCGSupport.NEVER:
        return 3, (
            f"support NEVER captures no graph of attention at all, so the FULL decode routine of {answer.name} "
            "cannot be"
        )
    if (
        answer.decode_mode() is CUDAGraphMode.FULL
        and exercise.uniform_decode_query_len > 1
        and support.value < AttentionCGSupport.UNIFORM_BATCH.value
    ):
        return 4, _why(4, exercise, answer)
    if answer.requires_piecewise_compilation() and not exercise.attention_compiled_piecewise:
        return 5, _why(5, exercise, answer)
    return None


def explain_miss(answer: CUDAGraphMode | str, result: Resolution, exercise: LoweringExercise) -> str:
    """Which rule a wrong answer missed, and a hint; never the resolved mode."""
    configured, steps = exercise.mode, result.steps
    if answer == RAISES:
        if exercise.enforce_eager:
            return "nothing is refused here: rule 1 comes before every rule that raises, and enforce_eager=True."
        if exercise.support is not AttentionCGSupport.NEVER:
            return (
                f"only support NEVER can make the resolver raise (rules 2 and 6); here the support is "
                f"{exercise.support.name}, so the rules lower the mode instead."
            )
        return (
            f"rule 2 raises only when the mixed routine is FULL, and {configured.name}'s is not; a FULL decode "
            "routine is lowered by rule 3 before the last guard (rule 6) looks."
        )
    assert isinstance(answer, CUDAGraphMode)  # RAISES is the one name an answer is read as
    if result.error is not None:
        return (
            f"{answer.name} is not what happens. Rule 2: the mixed routine of {configured.name} is FULL, and "
            "support NEVER captures no full graph at all, not even of decodes: there is no graph to keep, so "
            "the resolver refuses the configuration instead of lowering it."
        )
    if not steps:
        return "no rule applies to this configuration: check each rule's condition again, in order."
    first = steps[0].rule
    if answer is configured:
        return f"you kept {configured.name}, but rule {first} applies: {_why(first, exercise, configured)}."
    later = [i for i, step in enumerate(steps[:-1]) if step.after is answer]
    if later:
        i = later[0]
        return (
            f"{answer.name} is what rule {steps[i].rule} makes of {configured.name}, but the rules go on in order, "
            f"each on the result of the ones before: rule {steps[i + 1].rule} applies to {answer.name} too: "
            f"{_why(steps[i + 1].rule, exercise, answer)}."
        )
    broken = _broken_rule(answer, exercise)
    if broken is not None:
        return f"{answer.name} breaks rule {broken[0]}: {broken[1]}."
    routines = (("decode", CUDAGraphMode.decode_mode), ("mixed", CUDAGraphMode.mixed_mode))
    for kind, routine in routines:
        if routine(answer) is CUDAGraphMode.FULL and routine(configured) is not CUDAGraphMode.FULL:
            return (
                f"{answer.name} captures {kind} batches in FULL graphs, but {configured.name} asks for none: "
                "the rules only take full graphs away, they never add one."
            )
    fallback = (
        "the piecewise routine then runs eagerly, the other routine stays as it is"
        if first == 5
        else "where it lowers to depends on whether attention is compiled piecewise "
        f"(here it is{'' if exercise.attention_compiled_piecewise else ' not'})"
    )
    rank = {CUDAGraphMode.NONE: 0, CUDAGraphMode.PIECEWISE: 1, CUDAGraphMode.FULL: 2}
    resolved = steps[-1].after
    how = {CUDAGraphMode.NONE: "eagerly", CUDAGraphMode.PIECEWISE: "piecewise"}
    too_low = [
        f" Your answer runs {kind} batches {how[routine(answer)]}: more than the rules take away."
        for kind, routine in routines
        if rank[routine(answer)] < rank[routine(resolved)]
    ]
    return (
        f"{answer.name} breaks no rule, but it is not what the rules make of {configured.name}. Start from "
        f"{configured.name}: rule {first} applies ({_why(first, exercise, configured)}); {fallback}. Then apply "
        f"the later rules to the result.{''.join(too_low[:1])}"
    )


def worked_lowering(result: Resolution, exercise: LoweringExercise) -> str:
    """The resolver's path through the rules for this configuration, step by step."""
    lines = [str(exercise), "The rules that apply, in order:"]
    lines += [f"  rule {step.rule}: {step.before.name} -> {step.after.name} ({step.reason})" for step in result.steps]
    if result.error is not None:
        lines.append(f"  rule 2: {exercise.mode.name} raises ValueError ({result.error})")
    elif not result.warnings:
        lines.append("  no rule applies: the mode stays as configured")
    else:
        lines.append("  no later rule applies")
    if result.resolved is not None:
        mode = result.resolved
        lines.append(f"= {mode.name} (decode {mode.decode_mode().name}, mixed {mode.mixed_mode().name})")
    return "\n".join(lines)


def _check_lowering(number: int, answer: Any) -> CheckResult:
    exercise = LOWERING_EXERCISES[number]
    parsed = parse_mode_answer(answer)
    if parsed is None:
        return CheckResult(False, f"{answer!r} is neither a mode ({[m.name for m in CUDAGraphMode]}) nor ValueError.")
    result = exercise.resolve()  # only now, with the answer in
    if parsed == (RAISES if result.error else result.resolved):
        return CheckResult(True, f"Exercise {number}: {result.describe()}")
    return CheckResult(
        False,
        f"Exercise {number}: {explain_miss(parsed, result, exercise)}",
        reveal=lambda: worked_lowering(result, exercise),
    )


def _counted(number: int) -> Callable[[Any], CheckResult]:
    """Exercise `number`'s check, with its own count of wrong tries."""

    @exercise(f"08: lowering exercise {number} (rule {LOWERING_EXERCISES[number].rule})")
    def check(answer: Any) -> CheckResult:
        return _check_lowering(number, answer)

    return check


_LOWERING_CHECKS = {number: _counted(number) for number in LOWERING_EXERCISES}


def check_lowering(number: int, answer: Any) -> CheckResult:
    """Is `answer` what `resolve_cudagraph_mode` makes of `LOWERING_EXERCISES[number]`?

    `answer`: a `CUDAGraphMode`, its name, or `ValueError` / "ValueError" when you think it raises.
    Each exercise counts its wrong tries apart (`reveal()` after three).
    """
    if number not in _LOWERING_CHECKS:
        return CheckResult(False, f"There is no lowering exercise {number!r}; they are {list(LOWERING_EXERCISES)}.")
    return _LOWERING_CHECKS[number](answer)


def _support(name: Any) -> AttentionCGSupport:
    """An AttentionCGSupport or its name, in any case (as CUDAGraphMode.parse reads modes)."""
    return name if isinstance(name, AttentionCGSupport) else AttentionCGSupport[plain(name, "").strip().upper()]


@exercise("08: which configurations raise (rule 6)")
def check_raising(answer: Iterable[tuple[Any, Any]]) -> CheckResult:
    """Exercise 6: the set of (mode, support) pairs that raise (enforce_eager=False), whatever the
    compile setting and the decode query length (1 or 2).

    Pairs may use enums or names: {("FULL_DECODE_ONLY", "NEVER"), ...}.
    """
    try:
        # Each pair read once, into the checker's own set of enum members: only those are compared.
        given = {
            (CUDAGraphMode.parse(plain(m, Either((CUDAGraphMode.NONE, "")))), _support(s))
            for m, s in plain(answer, {(..., ...)})
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        return CheckResult(False, f"Give (mode, support) pairs of names or enums; could not read {answer!r} ({exc}).")

    # Only now, with the answer in: every pair, under every compile setting and decode length.
    def raises(mode: CUDAGraphMode, support: AttentionCGSupport) -> bool:
        return all(
            resolve_explained(
                mode,
                support,
                backend_name="MY_BACKEND",
                attention_compiled_piecewise=compiled,
                uniform_decode_query_len=q,
            ).error
            is not None
            for compiled, q in itertools.product((True, False), (1, 2))
        )

    expected = {pair for pair in itertools.product(CUDAGraphMode, AttentionCGSupport) if raises(*pair)}

    def worked() -> str:
        never = AttentionCGSupport.NEVER
        lines = ["Only support NEVER can raise (rules 2 and 6). With NEVER, compile=True, 1 query token:"]
        for mode in CUDAGraphMode:
            result = resolve_explained(mode, never, backend_name="MY_BACKEND", attention_compiled_piecewise=True)
            lines.append(
                f"  {mode.name}: "
                + (
                    "raises (rule 2: its mixed routine is FULL)"
                    if result.resolved is None
                    else f"resolves to {result.resolved.name}"
                )
            )
        lines.append(f"The set: {sorted((m.name, s.name) for m, s in expected)}")
        return "\n".join(lines)

    if given == expected:
        return CheckResult(
            True,
            f"Only {sorted((m.name, s.name) for m, s in expected)} raise(s), and rule 2 is what raises. {RULES[6]}",
        )
    extra = sorted(given - expected, key=lambda pair: (pair[0].value, pair[1].value))
    if extra:
        mode, support = extra[0]
        if support is not AttentionCGSupport.NEVER:
            why = (
                f"only support NEVER can make the resolver raise (rules 2 and 6); with {support.name} the rules "
                "lower the mode instead"
            )
        elif mode.decode_mode() is CUDAGraphMode.FULL:
            why = (
                "rule 2 raises only when the mixed routine is FULL; this FULL decode routine is lowered by rule 3 "
                "before the last guard (rule 6) looks"
            )
        else:
            why = "it asks for no full graph at all, so there is nothing to refuse"
        return CheckResult(False, f"({mode.name!r}, {support.name!r}) does not raise: {why}.", reveal=worked)
    return CheckResult(
        False,
        (
            "Your set misses pairs that raise. Hint: rule 2 refuses, rather than lowers, one kind "
            "of routine with one support level: which, and which modes have such a routine?"
        ),
        reveal=worked,
    )
