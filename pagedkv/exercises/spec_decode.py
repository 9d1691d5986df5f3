"""Notebook 13 (speculative decoding): checkers for what a step with drafts emits, the CUDA graph mode an
engine with k = 2 resolves to, and the KV slots the step rolls back.

    check_emitted(fn)          fn(draft_token_ids, target_token_ids) -> the tokens the step emits (greedy)
    check_spec_modes(answers)  the modes SPEC_MODE_CASES resolve to with 1 + 2 query tokens per decode
    check_rollback_slots(fn)   fn(block_ids, block_size, num_computed_tokens, draft_token_ids,
                               num_accepted_tokens) -> the slots written for rejected drafts

Functions are run on the notebook's cases and on cases made up per call, all before any expected value
exists; then each expected value comes from the package itself (the `RejectionSampler`, the lowering rules,
the runner's `compute_slot_mapping`), which an answer may not call. A wrong answer gets the rule it broke,
never the value; `reveal()` works the failing case out after three tries.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedkv.attention.selector import load_backend
from pagedkv.config import CUDAGraphMode
from pagedkv.engine.rejection_sampler import RejectionSampler
from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler, sampling_metadata
from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.exercises.cudagraph import RAISES, LoweringExercise, explain_miss, parse_mode_answer, worked_lowering
from pagedkv.worker.input_batch import compute_slot_mapping

VOCAB = 64
"""Token ids of the made-up cases are below this."""


# ---- exercise 1: what does a greedy step with drafts emit? --------------------------------------

EmitCase = tuple[list[int], list[int]]
SHOWN_EMIT_CASES: list[EmitCase] = [
    ([10, 11, 12], [10, 11, 12, 13]),  # all three accepted
    ([10, 11, 12], [10, 20, 12, 13]),  # the second rejected
    ([5, 6, 7], [9, 6, 7, 8]),  # the first rejected; the later ones match, too late
    ([], [42]),  # no draft: an ordinary decode
]
"""(draft_token_ids, target_token_ids) cases the notebook can print: target_token_ids[j] is the target's
greedy token after position j of the step (1 + len(drafts) of them)."""
EMIT_PACKAGE: list[Callable[..., Any]] = [RejectionSampler.__call__, Sampler.__call__]


def _random_emit_case(rng: random.Random) -> EmitCase:
    """k drafts; the target agrees with a random prefix of them, then goes its own way (or agrees again)."""
    k = rng.randint(0, 5)
    drafts = [rng.randrange(VOCAB) for _ in range(k)]
    agree = rng.randint(0, k)
    target = drafts[:agree] + [rng.randrange(VOCAB) for _ in range(k + 1 - agree)]
    if agree < k and rng.random() < 0.5:  # matches after the first mismatch: they must not count
        target[agree + 1 : k] = drafts[agree + 1 :]
    return drafts, target


def _emitted_by_the_engine(drafts: list[int], target: list[int]) -> list[int]:
    """The package's greedy verification: a `RejectionSampler` on logits whose argmax is `target`."""
    logits = torch.randn(len(target), VOCAB, generator=torch.Generator().manual_seed(len(drafts)))
    logits[torch.arange(len(target)), torch.tensor(target)] = 100.0
    rows = len(target)
    meta = sampling_metadata([SamplingParams(temperature=0)] * rows, [0] * rows, list(range(rows)), VOCAB, "cpu")
    out = RejectionSampler(Sampler())(logits, meta, [len(drafts)], torch.tensor(drafts, dtype=torch.long))
    assert out.num_tokens is not None  # a rejection sampler's output counts each request's tokens
    return out.token_ids[: int(out.num_tokens[0])].tolist()


def _emit_hint(got: list[int], drafts: list[int], target: list[int], accepted: int) -> str:
    if got == drafts[:accepted]:
        if accepted == len(drafts):
            return (
                "every draft was accepted, and the row after the last draft still gives a token of the target's "
                "own: the bonus token, emitted after them"
            )
        return (
            "after the accepted drafts the target always emits one token of its own: at the first draft it "
            "disagrees with, its own token takes the draft's place"
        )
    if got == drafts[: accepted + 1]:
        return "a rejected draft is not emitted: the target's own token at that position replaces it"
    if len(got) > accepted + 1:
        return (
            "acceptance stops at the first draft the target disagrees with: the drafts after it were proposed "
            "after a token that is now wrong, so they are dropped even where they match"
        )
    return (
        "emit the longest prefix of drafts equal to the target's tokens at their positions, then the target's "
        "token at the next position (a correction, or the bonus after the last draft)"
    )


@exercise("13: the tokens a step with drafts emits")
def check_emitted(fn: Callable[[list[int], list[int]], Any], num_hidden: int = 30) -> CheckResult:
    """`fn(draft_token_ids, target_token_ids)` -> the tokens a greedy step with these drafts emits, where
    target_token_ids[j] is the target's argmax after position j of the step (1 + len(drafts) tokens)."""
    own = package_answer(fn, EMIT_PACKAGE, "the verification")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_EMIT_CASES + [_random_emit_case(rng) for _ in range(num_hidden)]
    results, rejected = call_on_cases(
        fn, [(list(d), list(t)) for d, t in cases], EMIT_PACKAGE, "the verification", lambda c: f"fn{tuple(c)}"
    )
    if rejected is not None:
        return rejected
    for (drafts, target), got in zip(cases, results):
        call = f"fn({drafts}, {target})"
        try:
            got = plain(got, [0])  # plain ints: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; return a list of token ids (ints).")
        expected = _emitted_by_the_engine(drafts, target)
        if got == expected:
            continue
        accepted = len(expected) - 1

        def worked(drafts: list[int] = drafts, target: list[int] = target, call: str = call) -> str:
            lines = []
            for j, draft in enumerate(drafts):
                if draft != target[j]:
                    lines.append(f"draft {j + 1} = {draft}, the target says {target[j]}: rejected; emit {target[j]}")
                    break
                lines.append(f"draft {j + 1} = {draft}, the target says {target[j]}: accepted")
            else:
                lines.append(f"all accepted: the bonus is the target's token after the last draft, {target[-1]}")
            return "\n".join([*lines, f"{call} = {_emitted_by_the_engine(drafts, target)}"])

        hint = _emit_hint(got, drafts, target, accepted)
        return CheckResult(False, f"{call} = {got} is not what the step emits; {hint}.", reveal=worked)
    return CheckResult(True, f"Your tokens match the engine's RejectionSampler (greedy) on {len(cases)} cases.")


# ---- exercise 2: the CUDA graph mode with 1 + k query tokens per decode ----------------------------

NUM_SPECULATIVE_TOKENS = 2
SPEC_MODE_CASES: dict[str, tuple[str, CUDAGraphMode, bool]] = {
    "a": ("TRITON_ATTN", CUDAGraphMode.FULL_DECODE_ONLY, False),
    "b": ("TRITON_MLA", CUDAGraphMode.FULL_DECODE_ONLY, False),
    "c": ("TRITON_MLA", CUDAGraphMode.FULL_AND_PIECEWISE, True),
    "d": ("TORCH_REF", CUDAGraphMode.FULL_AND_PIECEWISE, True),
}
"""Case -> (the engine's weakest attention backend, cudagraph_mode, compiled with attention split out)."""


def spec_mode_case(case: str) -> LoweringExercise:
    """Case `case` of SPEC_MODE_CASES as a configuration of the lowering rules: its backend's support, and
    decodes of 1 + NUM_SPECULATIVE_TOKENS query tokens."""
    backend, mode, compiled = SPEC_MODE_CASES[case]
    support = load_backend(backend).get_builder_cls().cudagraph_support
    return LoweringExercise(
        0, mode, support, compiled, uniform_decode_query_len=1 + NUM_SPECULATIVE_TOKENS, backend_name=backend
    )


@exercise("13: the CUDA graph mode with k = 2")
def check_spec_modes(answers: Any) -> CheckResult:
    """`answers`: {case: mode} for every case of SPEC_MODE_CASES, each a `CUDAGraphMode` or its name (or
    ValueError when the engine refuses the configuration)."""
    try:  # plain str keys: a key's own == or hash takes no part
        answers = plain(answers, {"": ...})
    except TypeError:
        answers = None
    if answers is None or set(answers) != set(SPEC_MODE_CASES):
        return CheckResult(False, f"Give a dict with one mode per case: keys {sorted(SPEC_MODE_CASES)}.")
    parsed = {case: parse_mode_answer(answer) for case, answer in answers.items()}
    for case in sorted(SPEC_MODE_CASES):
        if parsed[case] is None:
            return CheckResult(
                False,
                f"case {case}: {answers[case]!r} is neither a mode ({[m.name for m in CUDAGraphMode]}) nor ValueError.",
            )
    for case in sorted(SPEC_MODE_CASES):  # only now, with every answer in
        config = spec_mode_case(case)
        result = config.resolve()
        answer = parsed[case]
        assert answer is not None  # every answer was read in the loop above
        if answer == (RAISES if result.error else result.resolved):
            continue
        return CheckResult(
            False,
            f"case {case} ({config.backend_name}, {config.mode.name}): {explain_miss(answer, result, config)}",
            reveal=functools.partial(worked_lowering, result, config),
        )
    return CheckResult(
        True, f"All {len(SPEC_MODE_CASES)} cases resolve as you said with {1 + NUM_SPECULATIVE_TOKENS}-token decodes."
    )


# ---- exercise 3: the KV slots rolled back ----------------------------------------------------------

SlotCase = tuple[list[int], int, int, list[int], int]
SHOWN_SLOT_CASES: list[SlotCase] = [
    ([3, 7, 9], 4, 6, [104, 105, 106], 1),
    ([5, 2], 8, 5, [1, 2, 3, 4], 0),
    ([4], 16, 3, [7, 7], 2),
    ([12, 3, 8], 2, 2, [9, 9, 9], 1),
]
"""(block_ids, block_size, num_computed_tokens, draft_token_ids, num_accepted_tokens) cases the notebook can
print: block_ids is the request's block-table row during the step."""
SLOT_PACKAGE: list[Callable[..., Any]] = [compute_slot_mapping]


def _random_slot_case(rng: random.Random) -> SlotCase:
    bs = rng.choice([1, 2, 4, 8, 16])
    computed, k = rng.randint(1, 40), rng.randint(1, 5)
    num_blocks = -(-(computed + 1 + k) // bs)
    block_ids = rng.sample(range(1, 10 * num_blocks + 10), num_blocks)
    return block_ids, bs, computed, [rng.randrange(VOCAB) for _ in range(k)], rng.randint(0, k)


def _slots(block_ids: list[int], block_size: int, positions: Sequence[int]) -> list[int]:
    """The runner's slot mapping of `positions` for one request with this block-table row."""
    if not positions:
        return []
    table = torch.tensor([block_ids], dtype=torch.int32)
    pos = torch.tensor(list(positions), dtype=torch.long)
    return compute_slot_mapping(table, torch.zeros_like(pos), pos, block_size).tolist()


def _slot_hint(got: list[int], case: SlotCase, expected: list[int]) -> str:
    block_ids, bs, computed, drafts, accepted = case
    k = len(drafts)
    rejected_positions = list(range(computed + 1 + accepted, computed + 1 + k))
    if sorted(got) == sorted(expected):
        return "list the slots in position order"
    if got == rejected_positions:
        return (
            "those are positions; a slot is block_ids[position // block_size] * block_size + "
            "position % block_size (the physical block, not the logical one)"
        )
    # A mistake can give the same slots as another on a case (1 accepted: one off = the first ones): name each.
    mistakes = [
        (
            range(computed + accepted, computed + k),
            "the step's first query position, num_computed_tokens, holds the request's last known token; draft i "
            "(from 0) sits at num_computed_tokens + 1 + i",
        ),
        (
            range(computed + 1, computed + 1 + k),
            "only rejected drafts roll back: the accepted ones' K/V now belong to the request",
        ),
        (
            range(computed + 1, computed + 1 + k - accepted),
            "the accepted drafts are the first ones (a prefix of the drafts); the rejected ones are the last",
        ),
    ]
    made = [hint for positions, hint in mistakes if got == _slots(block_ids, bs, positions)]
    if made:
        return "; or: ".join(made)
    return (
        "the rejected drafts are the last len(drafts) - num_accepted_tokens query positions; map each position to "
        "its block-table entry and offset"
    )


@exercise("13: the KV slots rolled back")
def check_rollback_slots(fn: Callable[[list[int], int, int, list[int], int], Any], num_hidden: int = 30) -> CheckResult:
    """`fn(block_ids, block_size, num_computed_tokens, draft_token_ids, num_accepted_tokens)` -> the KV slots
    the step wrote for its rejected drafts, in position order (the slots the rollback gives back)."""
    own = package_answer(fn, SLOT_PACKAGE, "the slot mapping")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_SLOT_CASES + [_random_slot_case(rng) for _ in range(num_hidden)]
    results, rejected = call_on_cases(
        fn,
        [(list(b), bs, c, list(d), a) for b, bs, c, d, a in cases],
        SLOT_PACKAGE,
        "the slot mapping",
        lambda case: f"fn{tuple(case)}",
    )
    if rejected is not None:
        return rejected
    for case, got in zip(cases, results):
        block_ids, bs, computed, drafts, accepted = case
        call = f"fn{case}"
        try:
            got = plain(got, [0])  # plain ints: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; return a list of slots (ints).")
        positions = range(computed + 1 + accepted, computed + 1 + len(drafts))
        expected = _slots(block_ids, bs, positions)
        if got == expected:
            continue

        def worked(case: SlotCase = case, positions: range = positions, call: str = call) -> str:
            block_ids, bs, computed, drafts, accepted = case
            lines = [
                f"query positions {computed}..{computed + len(drafts)}: the known token at {computed}, then "
                f"{len(drafts)} drafts; {accepted} accepted, so positions {list(positions)} are rejected"
            ]
            for p in positions:
                j, offset = divmod(p, bs)
                lines.append(
                    f"position {p}: block_ids[{j}] = {block_ids[j]}, offset {offset} -> slot {block_ids[j] * bs + offset}"
                )
            return "\n".join([*lines, f"{call} = {_slots(block_ids, bs, positions)}"])

        return CheckResult(
            False, f"{call} = {got} are not the slots rolled back; {_slot_hint(got, case, expected)}.", reveal=worked
        )
    return CheckResult(True, f"Your slots match the runner's slot mapping on {len(cases)} cases.")
