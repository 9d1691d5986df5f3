"""Notebook 01 (the model file): building one rank's attention module, and the checkers for the
fused qkv projection width and the tensor-parallel head layout."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.config import EngineConfig, ModelConfig, ParallelConfig, set_current_engine_config
from pagedkv.exercises import CheckResult, Either, call_on_cases, exercise, package_answer, plain
from pagedkv.models.configs import LlamaConfig
from pagedkv.models.layers import HeadLayout, head_layout
from pagedkv.models.llama import LlamaAttention
from pagedkv.models.parallel_layers import QKVParallelLinear

# (total query heads, total KV heads): MHA, GQA as in Llama-3-8B and -70B, an uneven GQA, MQA.
MODEL_HEADS: list[tuple[int, int]] = [(32, 32), (32, 8), (64, 8), (28, 4), (32, 1)]
TP_SIZES: list[int] = [1, 2, 4, 8, 16]


def build_attention(
    num_heads: int, num_kv_heads: int, tp_size: int = 1, head_dim: int = 128, hidden_size: int = 4096
) -> LlamaAttention:
    """One rank's `LlamaAttention` of this geometry, on the meta device (shapes only, no memory).

    It gets a fresh `EngineConfig`, so it registers in its own `static_forward_context`
    and not in any live engine's.
    """
    model = LlamaConfig(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
    )
    engine = EngineConfig(
        ModelConfig("sandbox", dtype=torch.bfloat16), parallel_config=ParallelConfig(tensor_parallel_size=tp_size)
    )
    with set_current_engine_config(engine), torch.device("meta"):
        return LlamaAttention(model, prefix="model.layers.0.self_attn", sliding_window=None)


# Qwen2-7B served over 4 GPUs: the case the notebook asks about first.
QWEN2_7B_TP4: dict[str, int] = {"hidden_size": 3584, "num_heads": 28, "num_kv_heads": 4, "head_dim": 128, "tp_size": 4}

QkvWidthFn = Callable[[int, int, int, int, int], Any]
Geometry = tuple[int, int, int]
"""(total query heads, total KV heads, tp_size)."""

# What builds a rank's module or computes its head counts: an answer that calls one is turned away.
_PACKAGE = (build_attention, head_layout, LlamaAttention.__init__, QKVParallelLinear.__init__)


def _geometry(rng: random.Random, kind: str) -> Geometry:
    """A made-up geometry of one `kind`, built to be so (no rule of the exercise decides it):

    "partitioned": at least as many KV heads as ranks, both head counts multiples of tp_size; the
    query heads are often no multiple of the KV heads, which LlamaAttention refuses (not the rule);
    "replicated": fewer KV heads than ranks, a divisor of tp_size; "uneven q": the query heads do not
    split over the ranks; "uneven kv": the KV heads can be neither split over nor copied onto them.
    """
    tp = rng.choice([2, 4, 8, 16, 32, 64])
    if kind == "partitioned":
        hkv = tp * rng.randint(1, 6)
        return hkv + tp * rng.randint(0, 8), hkv, tp
    if kind == "replicated":
        return tp * rng.randint(1, 8), rng.choice([d for d in range(1, tp) if tp % d == 0]), tp
    if kind == "uneven q":
        return tp * rng.randint(1, 8) + rng.randint(1, tp - 1), tp * rng.randint(1, 4), tp
    if kind == "uneven kv":
        tp = rng.choice([4, 8, 16, 32, 64])  # each has a KV head count below it that does not divide it
        hkv = rng.choice(
            [tp * rng.randint(1, 4) + rng.randint(1, tp - 1), rng.choice([d for d in range(2, tp) if tp % d])]
        )
        return tp * rng.randint(1, 8), hkv, tp
    raise ValueError(f"Unknown kind of geometry {kind!r}.")


def _qkv_hint(got: int, hidden_size: int, hq: int, hkv: int, d: int, tp: int) -> str:
    """What a wrong width most likely forgot, from the usual mistakes (never the right width)."""
    hints = {
        hq * d: "that is the whole model's query part alone; k and v follow it in the same output",
        (hq + 2 * hkv) * d: "that is the whole model's qkv_proj; a rank holds only its share of the heads",
        3 * (hq // tp) * d: "that gives every query head its own K and V, but GQA shares a KV head among "
        "several query heads",
        (hq // tp) * d: "that is only the query part; k and v follow it in the same output",
        (hq + hkv) * d // tp: "that counts each KV head once, but every KV head has a K part and a V part",
        hidden_size: "that is the input width (hidden_size), not the output width",
    }
    if hkv < tp:
        hints[(hq // tp + 2 * (hkv // tp)) * d] = (
            f"{hkv} KV head(s) cannot be split {tp} ways without giving some rank less than a whole head: "
            "each rank keeps one whole KV head (replicated)"
        )
        hints[(hq + 2 * hkv) * d // tp] = (
            "a KV head is never cut into pieces: with fewer KV heads than ranks, each rank keeps one whole KV head"
        )
    return hints.get(got, f"count the q, k and v heads this one rank holds, {d} features each")


@exercise("01: one rank's qkv_proj")
def check_qkv_width(fn: QkvWidthFn, num_hidden: int = 8) -> CheckResult:
    """Does `fn(hidden_size, num_heads, num_kv_heads, head_dim, tp_size)` give the output width of one
    rank's fused qkv_proj?

    Tried on Qwen2-7B at tp_size 4, two layouts with replicated KV heads, one LlamaAttention refuses
    to build (query heads no multiple of the KV heads), then `num_hidden` made-up geometries drawn
    afresh on each call, many of them refused the same way: building the module cannot answer them.
    A function that builds the module or asks head_layout is turned away.
    """
    own = package_answer(fn, _PACKAGE[:2], "the count")
    if own is not None:
        return own
    rng = random.Random()
    cases = [
        tuple(QWEN2_7B_TP4[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "tp_size")),
        (4096, 64, 8, 128, 16),
        (2048, 32, 1, 128, 8),  # KV heads replicated, which random draws reach less often
        (3072, 48, 32, 128, 16),  # 48 query heads over 32 KV heads: LlamaAttention refuses to build it
    ]
    for hq, hkv, tp in (_geometry(rng, rng.choice(["partitioned", "replicated"])) for _ in range(num_hidden)):
        cases.append((64 * hq, hq, hkv, rng.choice([64, 80, 96, 128, 256]), tp))
    answers, rejected = call_on_cases(
        fn,
        cases,
        _PACKAGE,
        "the count",
        lambda case: "fn({}, {}, {}, {}, {})".format(*case),
    )
    if rejected is not None:
        return rejected

    # The rule, applied here only now that the student's code has run.
    def width(hq: int, hkv: int, d: int, tp: int) -> tuple[int, int, int]:
        """(query heads, KV heads) of one rank, and its qkv_proj width."""
        kv = hkv // tp if hkv >= tp else 1
        return hq // tp, kv, (hq // tp + 2 * kv) * d

    def worked(h: int, hq: int, hkv: int, d: int, tp: int) -> str:
        q, kv, w = width(hq, hkv, d, tp)
        kv_why = f"{hkv} / {tp} = {kv}" if hkv >= tp else f"{hkv} < {tp} ranks, so each rank keeps {kv} whole head"
        return (
            f"fn({h}, {hq}, {hkv}, {d}, {tp}): query heads per rank {hq} / {tp} = {q}; KV heads per rank: "
            f"{kv_why}; q, k and v: ({q} + 2 x {kv}) heads x {d} features = {w}"
        )

    for got, (h, hq, hkv, d, tp) in zip(answers, cases):
        call = f"fn({h}, {hq}, {hkv}, {d}, {tp})"
        try:
            got = plain(got, 0)  # a plain int: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; give a whole number of features (an int).")
        if got != width(hq, hkv, d, tp)[2]:
            return CheckResult(
                False,
                f"{call}: {got} is not it: {_qkv_hint(got, h, hq, hkv, d, tp)}.",
                reveal=functools.partial(worked, h, hq, hkv, d, tp),
            )
    q, kv, w = width(*(QWEN2_7B_TP4[k] for k in ("num_heads", "num_kv_heads", "head_dim", "tp_size")))
    return CheckResult(
        True,
        f"Qwen2-7B at tp_size 4: one rank's qkv_proj has {w} output features = "
        f"({q} + 2 x {kv}) heads x 128. Your function also gets {len(cases) - 1} other geometries "
        "right, some of them ones LlamaAttention refuses to build.",
    )


def _layout_inputs(num_hidden: int, rng: random.Random) -> list[Geometry]:
    """Every MODEL_HEADS x TP_SIZES geometry (the notebook's table and the ones it skips), then
    `num_hidden` made-up ones of every kind, at least one each (see `_geometry`)."""
    kinds = ["partitioned", "replicated", "uneven q", "uneven kv"]
    drawn = kinds[: min(num_hidden, 4)] + [rng.choice(kinds) for _ in range(num_hidden - 4)]
    return [(hq, hkv, tp) for hq, hkv in MODEL_HEADS for tp in TP_SIZES] + [_geometry(rng, k) for k in drawn]


@exercise("01: the tensor-parallel head layout")
def check_head_layout(fn: Callable[[int, int, int], Any], num_hidden: int = 12) -> CheckResult:
    """Does `fn(total_num_heads, total_num_kv_heads, tp_size)` lay heads out over ranks as the engine does?

    `fn` returns (query heads per rank, KV heads per rank, ranks holding each KV head), or None for a
    geometry the engine refuses (heads that split over the ranks neither evenly nor by whole copies).
    Tried on MODEL_HEADS x TP_SIZES, then on `num_hidden` made-up geometries drawn afresh on each call:
    ones head_layout refuses (it raises where the answer is None) and ones LlamaAttention refuses to
    build. A function that asks head_layout or builds the module is turned away.
    """
    own = package_answer(fn, _PACKAGE[:2], "the layout rules")
    if own is not None:
        return own
    cases = _layout_inputs(num_hidden, random.Random())
    answers, rejected = call_on_cases(
        fn,
        cases,
        _PACKAGE,
        "the layout rules",
        lambda case: "fn({}, {}, {})".format(*case),
    )
    if rejected is not None:
        return rejected

    # The rules, applied here only now that the student's code has run.
    def refusal(hq: int, hkv: int, tp: int) -> str | None:
        """Why the engine refuses this geometry, or None when the heads split."""
        if hq % tp:
            return f"{hq} query heads do not split evenly over {tp} ranks"
        if hkv % tp if hkv >= tp else tp % hkv:
            return f"{hkv} KV heads can be neither split evenly over {tp} ranks nor copied evenly onto them"
        return None

    def layout(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        return (hq // tp, hkv // tp, 1) if hkv >= tp else (hq // tp, 1, tp // hkv)

    def worked(hq: int, hkv: int, tp: int) -> str:
        head = f"fn({hq}, {hkv}, {tp}): "
        if (why := refusal(hq, hkv, tp)) is not None:
            return head + f"{why}: the engine refuses the model -> None"
        q, kv, copies = layout(hq, hkv, tp)
        if hkv >= tp:
            return (
                head + f"query heads {hq} / {tp} = {q}; {hkv} KV heads >= {tp} ranks: split, {hkv} / {tp} = {kv}, "
                f"no copies -> ({q}, {kv}, 1)"
            )
        return head + (
            f"query heads {hq} / {tp} = {q}; {hkv} KV heads < {tp} ranks: each rank keeps 1 whole KV head, "
            f"each KV head copied to {tp} / {hkv} = {copies} ranks -> ({q}, 1, {copies})"
        )

    fields = ("query heads per rank", "KV heads per rank", "replicas of each KV head")
    for got, (hq, hkv, tp) in zip(answers, cases):
        case = f"For {hq} query heads, {hkv} KV heads, tp_size {tp}"
        if type(got) is HeadLayout:  # pagedkv's own (frozen) layout: its fields are plain ints
            got = (got.num_heads, got.num_kv_heads, got.kv_head_replicas)
        try:  # plain ints: an answer's own == takes no part in the comparisons
            got = plain(got, Either(((0, 0, 0), None)))
        except TypeError as error:
            return CheckResult(False, f"{case}: {error}; return a tuple of three ints (or None).")
        reveal = functools.partial(worked, hq, hkv, tp)
        why = refusal(hq, hkv, tp)
        if why is not None:
            if got is not None:
                return CheckResult(
                    False,
                    f"{case}: the engine refuses this model ({why}); your function returned "
                    f"{got} instead of refusing it too.",
                    reveal=reveal,
                )
            continue
        if got is None:
            return CheckResult(
                False, f"{case}: the heads split over the ranks, but your function refused them.", reveal=reveal
            )
        want = layout(hq, hkv, tp)
        if got == want:
            continue
        wrong = [f"{f} {g} is not it" for f, g, w in zip(fields, got, want) if g != w]
        if got[0] != want[0]:
            hint = "query heads are always split evenly over the ranks"
        elif hkv >= tp:
            hint = "with at least as many KV heads as ranks, KV heads are split like query heads; nothing is copied"
        else:
            hint = (
                "with fewer KV heads than ranks, a rank cannot hold a fraction of a head: each rank keeps "
                "one whole KV head, and each KV head is copied to as many ranks as it takes for every rank "
                "to have one"
            )
        return CheckResult(False, f"{case}: " + ", ".join(wrong) + f". Hint: {hint}.", reveal=reveal)
    return CheckResult(
        True,
        f"Your layout matches the engine's in all {len(cases)} cases ({num_hidden} of them "
        "made-up geometries the notebook never printed, some the engine refuses).",
    )
