"""Checkers for notebook 01 (the model file): the fused qkv projection and the TP head layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.engine.llm import LLM
from pagedkv.exercises import CheckResult
from pagedkv.models.layers import HeadLayout, head_layout
from pagedkv.models.llama import LlamaAttention

# (total query heads, total KV heads): MHA, GQA as in Llama-3-8B and -70B, an uneven GQA, MQA.
MODEL_HEADS: list[tuple[int, int]] = [(32, 32), (32, 8), (64, 8), (28, 4), (32, 1)]
TP_SIZES: list[int] = [1, 2, 4, 8, 16]


def attention_module(llm: LLM, layer: int = 0) -> LlamaAttention:
    """The model file's attention module of decoder layer `layer` (qkv_proj, rotary_emb, attn, o_proj)."""
    return llm.model.model.layers[layer].self_attn


def check_qkv_width(llm: LLM, answer: Any) -> CheckResult:
    """Is `answer` the number of output features of layer 0's fused qkv_proj?"""
    attn = attention_module(llm)
    expected = attn.qkv_proj.out_features
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if not isinstance(answer, int) or isinstance(answer, bool):
        return CheckResult(False, f"Give a whole number of features (an int), got {answer!r}.")
    if answer == expected:
        return CheckResult(True, f"qkv_proj has {expected} output features = ({hq} + 2 x {hkv}) heads x {d}.")
    hints = {
        hq * d: "that is only the query part",
        3 * hq * d: f"that counts as many K and V heads as query heads; this model has {hkv} KV heads for {hq} query heads",
        (hq + hkv) * d: "that counts K and V together as one set of KV heads; each KV head has a K and a V",
        llm.model_config.hidden_size: "that is the input width (hidden_size), not the output width",
    }
    hint = hints.get(answer, f"the output holds q, k and v of every head of this rank, {d} features per head")
    return CheckResult(False, f"{answer} is not it: {hint}.")


def _as_triple(result: Any) -> tuple[int, int, int] | None:
    if isinstance(result, HeadLayout):
        return (result.num_heads, result.num_kv_heads, result.kv_head_replicas)
    if isinstance(result, (tuple, list)) and len(result) == 3 and all(isinstance(x, int) for x in result):
        return tuple(result)  # type: ignore[return-value]
    return None


def check_head_layout(fn: Callable[[int, int, int], Any]) -> CheckResult:
    """Compare `fn(total_num_heads, total_num_kv_heads, tp_size)` with the engine's `head_layout`.

    `fn` returns (query heads per rank, KV heads per rank, ranks holding each KV head).
    Every valid combination of MODEL_HEADS and TP_SIZES is tried.
    """
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    tried = 0
    for hq, hkv in MODEL_HEADS:
        for tp in TP_SIZES:
            try:
                expected = head_layout(hq, hkv, tp)
            except ValueError:
                continue  # heads do not split evenly: not a valid deployment
            tried += 1
            want = (expected.num_heads, expected.num_kv_heads, expected.kv_head_replicas)
            try:
                got_raw = fn(hq, hkv, tp)
            except Exception as exc:
                return CheckResult(False, f"fn({hq}, {hkv}, {tp}) raised {type(exc).__name__}: {exc}.")
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
    return CheckResult(True, f"Your layout matches head_layout in all {tried} valid (model, tp_size) cases.")
