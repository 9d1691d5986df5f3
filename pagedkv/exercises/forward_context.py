"""Checkers for notebook 03 (the forward context): resolve a layer name like the attention op does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.attention.layer import Attention, get_attention_context
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, package_answer, used_package, watch_calls
from pagedkv.forward_context import get_forward_context

_FIELDS = ("attn_metadata", "layer", "kv_cache", "slot_mapping")


def _same(got: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.data_ptr() == expected.data_ptr() and got.shape == expected.shape
    return got is expected


def _explain(field: str, got: Any, expected: Any, layer_name: str, context: Any) -> str:
    """Why `got` is not the `field` that `get_attention_context(layer_name)` returns."""
    if field == "attn_metadata" and got is context.attn_metadata:
        return "you returned the whole attn_metadata dict; take this layer's entry: attn_metadata[layer_name]"
    if field == "slot_mapping" and got is context.slot_mapping:
        return "you returned the whole slot_mapping dict; take this layer's entry (it may be missing: use .get)"
    if field == "attn_metadata" and any(got is m for m in context.attn_metadata.values()):
        return "that is the metadata of a layer in another group; index attn_metadata with this layer's name"
    if field == "slot_mapping" and any(_same(got, m) for m in context.slot_mapping.values()):
        return ("that is the slot mapping of a layer in another KV cache group (each group has its own slots); "
                "index slot_mapping with this layer's name")
    if field == "layer" and isinstance(got, torch.nn.Module) and not isinstance(got, Attention):
        return (f"that is a {type(got).__name__}; the registry no_compile_layers holds the generic "
                "Attention layer under the name")
    if field == "layer" and isinstance(got, Attention):
        return f"that is the layer registered as {got.layer_name!r}, not {layer_name!r}"
    if field == "kv_cache" and isinstance(got, torch.Tensor):
        return (f"a tensor of shape {tuple(got.shape)}, but not this layer's cache "
                f"{tuple(expected.shape)}: the layer object carries it, as layer.kv_cache")
    return f"got {type(got).__name__}, expected this layer's {field} ({type(expected).__name__})"


def check_attention_context(llm: LLM, fn: Callable[[str], Any]) -> CheckResult:
    """Call `fn(layer_name)` inside real forward passes of `llm`, for every attention layer, and
    compare with the engine's `get_attention_context(layer_name)`:
    (attn_metadata, layer, kv_cache, slot_mapping), the very same objects. When `llm` has one KV
    cache group (every layer shares one metadata object), "tiny-hybrid" (two groups) is served too:
    else a lookup that ignores the layer name would pass.
    """
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself, got {fn!r}.")
    own = package_answer(fn, [get_attention_context], "the lookup")
    if own is not None:
        return own
    engines = [llm]
    if len(llm.runner.kv_cache_config.kv_cache_groups) == 1:
        # Eager: the lookups run in a layer hook, and a replayed CUDA graph runs no Python (notebook 08).
        engines.append(LLM("tiny-hybrid", device=llm.config.device, num_kv_blocks=32, enforce_eager=True))
    total = 0
    for engine in engines:
        problem, calls = _check_lookups(engine, fn)
        if problem:
            return CheckResult(False, problem + ".")
        total += calls
    return CheckResult(True, f"Your lookup returned the engine's own objects in all {total} layer calls "
                             f"({' and '.join(repr(e.config.model_config.model) for e in engines)}, 2 steps each).")


def _check_lookups(llm: LLM, fn: Callable[[str], Any]) -> tuple[str | None, int]:
    """(the first wrong lookup, how many calls were checked) over two steps of `llm`."""
    problems: list[str] = []
    calls = 0

    def compare(module: Attention, args: tuple[Any, ...]) -> None:
        nonlocal calls
        if problems:
            return
        calls += 1
        name = module.layer_name
        expected = get_attention_context(name)
        try:
            with watch_calls([get_attention_context]) as called:
                got = fn(name)
        except Exception as exc:  # noqa: BLE001  (the student's code may raise anything)
            if not called:
                problems.append(f"{_signature(name)} raised {type(exc).__name__}: {exc}")
                return
        if called:
            problems.append(used_package(called, "the lookup").message.rstrip("."))
            return
        if not isinstance(got, tuple) or len(got) != 4:
            problems.append(f"{_signature(name)} returned {type(got).__name__}; return a tuple of 4: {_FIELDS}")
            return
        context = get_forward_context()
        for field, g, e in zip(_FIELDS, got, expected):
            if not _same(g, e):
                problems.append(f"{_signature(name)}: {field} is wrong: {_explain(field, g, e, name, context)}")
                return

    hooks = [layer.register_forward_pre_hook(compare) for layer in llm.runner.attn_layers.values()]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params)
    finally:
        for hook in hooks:
            hook.remove()
    return (problems[0] if problems else None), calls


def _signature(layer_name: str) -> str:
    return f"fn({layer_name!r})"
