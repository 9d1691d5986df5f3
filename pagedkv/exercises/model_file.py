"""Notebook 01 (the model file): building one rank's attention module, and the checkers for the
fused qkv projection width and the tensor-parallel head layout."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedkv.config import EngineConfig, ModelConfig, ParallelConfig, set_current_engine_config
from pagedkv.exercises import CheckResult, call_answer, package_answer
from pagedkv.models.layers import HeadLayout, head_layout
from pagedkv.models.llama import LlamaAttention, LlamaConfig

# (total query heads, total KV heads): MHA, GQA as in Llama-3-8B and -70B, an uneven GQA, MQA.
MODEL_HEADS: list[tuple[int, int]] = [(32, 32), (32, 8), (64, 8), (28, 4), (32, 1)]
TP_SIZES: list[int] = [1, 2, 4, 8, 16]


def build_attention(num_heads: int, num_kv_heads: int, tp_size: int = 1,
                    head_dim: int = 128, hidden_size: int = 4096) -> LlamaAttention:
    """One rank's `LlamaAttention` of this geometry, on the meta device (shapes only, no memory).

    It gets a fresh `EngineConfig`, so it registers in its own `static_forward_context`
    and not in any live engine's.
    """
    model = LlamaConfig(hidden_size=hidden_size, num_attention_heads=num_heads,
                        num_key_value_heads=num_kv_heads, head_dim=head_dim, num_hidden_layers=1)
    engine = EngineConfig(ModelConfig("sandbox", dtype=torch.bfloat16),
                          parallel_config=ParallelConfig(tensor_parallel_size=tp_size))
    with set_current_engine_config(engine), torch.device("meta"):
        return LlamaAttention(model, prefix="model.layers.0.self_attn", sliding_window=None)


# Qwen2-7B served over 4 GPUs: the case the notebook asks about first.
QWEN2_7B_TP4: dict[str, int] = {"hidden_size": 3584, "num_heads": 28, "num_kv_heads": 4, "head_dim": 128, "tp_size": 4}

QkvWidthFn = Callable[[int, int, int, int, int], Any]


def _qkv_verdict(answer: Any, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 hidden_size: int, tp_size: int) -> CheckResult:
    """Is `answer` the number of output features of one rank's fused qkv_proj for this geometry?

    The expected value is read from a real `LlamaAttention` built for one rank.
    """
    if not isinstance(answer, int) or isinstance(answer, bool):
        return CheckResult(False, f"Give a whole number of features (an int), got {answer!r}.")
    rank = build_attention(num_heads, num_kv_heads, tp_size, head_dim, hidden_size)
    expected = rank.qkv_proj.out_features
    hq, hkv, d = rank.num_heads, rank.num_kv_heads, head_dim
    if answer == expected:
        return CheckResult(
            True, f"One rank's qkv_proj has {expected} output features = ({hq} + 2 x {hkv}) heads x {d}."
        )
    hints = {
        hq * d: "that is only the query part; k and v follow it in the same output",
        3 * hq * d: f"that gives every query head its own K and V, but each rank holds only {hkv} KV head(s) "
                    f"for its {hq} query heads",
        (hq + hkv) * d: "that counts each KV head once, but every KV head has a K part and a V part",
        hidden_size: "that is the input width (hidden_size), not the output width",
    }
    if tp_size > 1:
        hints[(num_heads + 2 * num_kv_heads) * d] = (
            f"that is the whole model's qkv_proj; with tp_size {tp_size} a rank holds only its share of the heads")
        hints[(num_heads // tp_size + 2 * (num_kv_heads // tp_size)) * d] = (
            f"{num_kv_heads} KV heads cannot be split {tp_size} ways without giving some rank less than "
            "a whole head: each rank keeps one whole KV head (replicated)")
    hint = hints.get(answer, f"count the q, k and v heads this one rank holds, {d} features each")
    return CheckResult(False, f"{answer} is not it: {hint}.")


def check_qkv_width(fn: QkvWidthFn, num_hidden: int = 8) -> CheckResult:
    """Compare `fn(hidden_size, num_heads, num_kv_heads, head_dim, tp_size)` with the output width
    of one rank's real qkv_proj: first Qwen2-7B at tp_size 4, then `num_hidden` random geometries
    drawn afresh on each call. A function that builds the module (build_attention, LlamaAttention)
    or asks head_layout is turned away.
    """
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    own = package_answer(fn, [build_attention, head_layout], "the count")
    if own is not None:
        return own
    rng = random.Random()
    hidden = [(hq, hkv, tp) for hq, hkv, tp, _ in _layout_cases(num_hidden, rng)][-num_hidden:]
    # Then always two layouts with KV heads replicated (more ranks than KV heads), which random
    # geometries reach only now and then.
    replicated = [{"hidden_size": 64 * hq, "num_heads": hq, "num_kv_heads": hkv, "head_dim": 128, "tp_size": tp}
                  for hq, hkv, tp in ((64, 8, 16), (32, 1, 8))]
    cases = [QWEN2_7B_TP4, *replicated] + [
        {"hidden_size": 64 * hq, "num_heads": hq, "num_kv_heads": hkv, "head_dim": rng.choice([64, 80, 128]),
         "tp_size": tp} for hq, hkv, tp in hidden
    ]
    first: CheckResult | None = None
    for case in cases:
        call = "fn({hidden_size}, {num_heads}, {num_kv_heads}, {head_dim}, {tp_size})".format(**case)
        args = [case[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "tp_size")]
        got, rejected = call_answer(fn, args, [build_attention, head_layout, LlamaAttention.__init__], "the count", call)
        if rejected is not None:
            return rejected
        verdict = _qkv_verdict(got, **case)
        if not verdict:
            return CheckResult(False, f"{call}: {verdict.message}")
        first = first or verdict
    return CheckResult(True, f"Qwen2-7B at tp_size 4: {first.message if first else ''} Your function also "
                             f"matches the real module on 2 replicated-KV layouts and {num_hidden} random geometries.")


def _as_triple(result: Any) -> tuple[int, int, int] | None:
    if isinstance(result, HeadLayout):
        return (result.num_heads, result.num_kv_heads, result.kv_head_replicas)
    if isinstance(result, (tuple, list)) and len(result) == 3 and all(isinstance(x, int) for x in result):
        return tuple(result)  # type: ignore[return-value]
    return None


def _layout_cases(num_hidden: int, rng: random.Random) -> Iterator[tuple[int, int, int, HeadLayout]]:
    """(query heads, KV heads, tp_size, expected layout): every valid MODEL_HEADS x TP_SIZES case,
    then `num_hidden` random geometries the notebook never prints."""
    for hq, hkv in MODEL_HEADS:
        for tp in TP_SIZES:
            try:
                yield hq, hkv, tp, head_layout(hq, hkv, tp)
            except ValueError:
                continue  # heads do not split evenly: not a valid deployment
    found = 0
    while found < num_hidden:
        hkv = rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 16, 40])
        hq, tp = hkv * rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([1, 2, 4, 8, 16, 32, 64])
        try:
            layout = head_layout(hq, hkv, tp)
        except ValueError:
            continue
        found += 1
        yield hq, hkv, tp, layout


def check_head_layout(fn: Callable[[int, int, int], Any], num_hidden: int = 12) -> CheckResult:
    """Compare `fn(total_num_heads, total_num_kv_heads, tp_size)` with the engine's `head_layout`.

    `fn` returns (query heads per rank, KV heads per rank, ranks holding each KV head).
    Every valid combination of MODEL_HEADS and TP_SIZES is tried, then `num_hidden` random
    geometries drawn afresh on each call (so a table copied from the notebook does not pass).
    A function that hands the work to `head_layout` (or builds a LlamaAttention) is turned away.
    """
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    own = package_answer(fn, [head_layout, build_attention], "the layout rules")
    if own is not None:
        return own
    tried = 0
    for hq, hkv, tp, expected in _layout_cases(num_hidden, random.Random()):
        tried += 1
        want = (expected.num_heads, expected.num_kv_heads, expected.kv_head_replicas)
        got_raw, rejected = call_answer(fn, (hq, hkv, tp), [head_layout], "the layout rules", f"fn({hq}, {hkv}, {tp})")
        if rejected is not None:
            return rejected
        got = _as_triple(got_raw)
        case = f"{hq} query heads, {hkv} KV heads, tp_size {tp}"
        if got is None:
            return CheckResult(False, f"For {case} fn returned {got_raw!r}; return a tuple of three ints.")
        if got == want:
            continue
        fields = ("query heads per rank", "KV heads per rank", "replicas of each KV head")
        wrong = [f"{f} {g} (expected {w})" for f, g, w in zip(fields, got, want) if g != w]
        if hkv >= tp:
            hint = "with at least as many KV heads as ranks, KV heads are split like query heads; nothing is copied"
        else:
            hint = (
                "with fewer KV heads than ranks, a rank cannot hold a fraction of a head: each rank keeps "
                "one whole KV head, and each KV head is copied to tp_size / num_kv_heads ranks"
            )
        return CheckResult(False, f"For {case}: " + ", ".join(wrong) + f". Hint: {hint}.")
    return CheckResult(True, f"Your layout matches head_layout in all {tried} valid cases "
                             f"({num_hidden} of them random geometries the notebook never printed).")
