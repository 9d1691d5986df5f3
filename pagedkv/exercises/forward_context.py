"""Checker for notebook 03 (the forward context): resolve a layer name like the attention op does.

`check_attention_context(llm, fn)` calls the student's `fn(layer_name)` where the attention op
would call `get_attention_context`: inside real forward passes (of `llm`, and of "tiny-hybrid",
whose two KV cache groups give two metadata objects and two slot mappings), and inside forward
contexts it makes up itself (layer names no model uses, a registry of stand-in layers, slot
mappings missing for some layers, a profile run without metadata). Every call is recorded first;
only then does the checker work out, object by object, what the lookup should have returned.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.attention.ops import get_attention_context
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, call_answer, exercise, package_answer, plain
from pagedkv.forward_context import ForwardContext, get_forward_context, set_forward_context

_FIELDS = ("attn_metadata", "layer", "kv_cache", "slot_mapping")


@dataclass
class _Call:
    """One call of the student's lookup: where it ran, the name it got, what it returned."""

    where: str
    name: str
    context: ForwardContext
    got: Any


@dataclass
class _StandInLayer:
    """A layer object of a made-up registry: what the lookup may read from it is its cache."""

    layer_name: str
    kv_cache: torch.Tensor


def _made_up_contexts(rng: random.Random) -> list[tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any]]]:
    """(label, registry, attn_metadata, slot_mapping) of forward contexts no engine makes:
    names of no model, layers split into groups that share a metadata object, slot mappings
    missing for some layers, and a profile run (no metadata, no slots)."""
    stems = ["decoder.blocks", "vision_tower.layers", "mtp.heads", "backbone.mixers"]
    names = [
        f"{rng.choice(stems)}.{i}.{rng.choice(['attn', 'self_attention', 'mixer.attn'])}"
        for i in rng.sample(range(40), 5)
    ]
    registry = {n: _StandInLayer(n, torch.zeros(2, rng.randint(3, 9), rng.choice([2, 5]), 1, 4)) for n in names}
    groups = [names[0::2], names[1::2]]
    metadata: dict[str, Any] = {}
    for g, members in enumerate(groups):
        shared = SimpleNamespace(group=g, seq_lens=[rng.randint(1, 50)])  # one object per group, like a build
        metadata.update(dict.fromkeys(members, shared))
    slots = {n: torch.randint(0, 40, (rng.randint(1, 6),)) for n in names if rng.random() < 0.6 or n == names[0]}
    slots.pop(names[1], None)  # at least one layer without a slot mapping: the lookup gives None
    return [("a made-up step", registry, metadata, slots), ("a made-up profile run", registry, None, {})]


def _lookups_in_made_up_contexts(
    fn: Callable[[str], Any], rng: random.Random
) -> tuple[list[_Call], CheckResult | None]:
    """Call fn(name) for every layer name inside each made-up context."""
    calls: list[_Call] = []
    for where, registry, metadata, slots in _made_up_contexts(rng):
        config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=registry))
        with set_forward_context(metadata, config, slot_mapping=slots) as context:  # type: ignore[arg-type]
            for name in rng.sample(list(registry), len(registry)):
                got, rejected = call_answer(
                    fn, [name], [get_attention_context], "the lookup", f"In {where}, fn({name!r})"
                )
                if rejected is not None:
                    return calls, rejected
                calls.append(_Call(where, name, context, got))
    return calls, None


def _lookups_in_engine(llm: LLM, fn: Callable[[str], Any]) -> tuple[list[_Call], CheckResult | None]:
    """Call fn(name) in every attention layer's forward pass (a pre-hook) over two steps of `llm`."""
    calls: list[_Call] = []
    rejections: list[CheckResult] = []
    model = llm.config.model_config.model

    def lookup(module: Any, args: tuple[Any, ...]) -> None:
        if rejections:
            return
        name, where = module.layer_name, f"a step of {model!r}"
        got, rejected = call_answer(fn, [name], [get_attention_context], "the lookup", f"In {where}, fn({name!r})")
        if rejected is not None:
            rejections.append(rejected)
            return
        calls.append(_Call(where, name, get_forward_context(), got))

    hooks = [layer.register_forward_pre_hook(lookup) for layer in llm.runner.attn_layers.values()]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params, use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, (rejections[0] if rejections else None)


@exercise("03: resolve a layer name in the forward context")
def check_attention_context(llm: LLM, fn: Callable[[str], Any]) -> CheckResult:
    """Call `fn(layer_name)` where the attention op resolves its name, and compare what it returns,
    object by object, with (attn_metadata, layer, kv_cache, slot_mapping) of that layer in that
    context: inside two steps of `llm`, two of "tiny-hybrid" when `llm` has one KV cache group
    (else a lookup that ignores the name would pass), and two forward contexts the checker makes up.
    """
    own = package_answer(fn, [get_attention_context], "the lookup")
    if own is not None:
        return own
    engines = [llm]
    if len(llm.runner.kv_cache_config.kv_cache_groups) == 1:
        # Eager: the lookups run in a layer hook, and a replayed CUDA graph runs no Python (notebook 08).
        engines.append(
            LLM(
                "tiny-hybrid",
                device=llm.config.device,
                num_kv_blocks=32,
                enforce_eager=True,
                enable_prefix_caching=False,
            )
        )
    calls: list[_Call] = []
    rejected: CheckResult | None = None
    for engine in engines:
        more, rejected = _lookups_in_engine(engine, fn)
        calls += more
        if rejected is not None:
            break
    if rejected is None:
        more, rejected = _lookups_in_made_up_contexts(fn, random.Random())
        calls += more
    # The calls have returned (or one was turned away): only now is the right answer of each worked out.
    for call in calls:
        wrong = _first_wrong_field(call)
        if wrong is not None:
            return wrong
    if rejected is not None:
        return rejected
    places = sorted({c.where for c in calls})
    return CheckResult(
        True,
        f"Your lookup returned the very objects of the forward context in all {len(calls)} "
        f"calls ({', '.join(places)}).",
    )


def _first_wrong_field(call: _Call) -> CheckResult | None:
    """None if `call` returned this layer's four objects, else what is wrong (and how to work it out)."""
    context, name, got = call.context, call.name, call.got
    signature = f"In {call.where}, fn({name!r})"
    try:  # four entries read once through tuple's own methods; then compared by identity only
        got = plain(got, (..., ..., ..., ...))
    except TypeError as error:
        return CheckResult(
            False,
            f"{signature}: {error}; return a tuple of 4: {_FIELDS}.",
            reveal=lambda: _worked_lookup(call),
        )
    layer = context.no_compile_layers[name]
    metadata = context.attn_metadata
    assert not isinstance(metadata, list)  # the exercise's contexts hold one dict (no micro-batches)
    right = (
        None if metadata is None else metadata[name],
        layer,
        layer.kv_cache,
        context.slot_mapping.get(name),
    )
    for field, g, e in zip(_FIELDS, got, right):
        if not _same(g, e):
            return CheckResult(
                False,
                f"{signature}: {field} is wrong: {_explain(field, g, name, context)}.",
                reveal=lambda: _worked_lookup(call),
            )
    return None


def _same(got: Any, expected: Any) -> bool:
    """The very object (a tensor: the same memory and shape; None: None)."""
    if isinstance(expected, torch.Tensor):
        # exactly a tensor: a subclass could answer data_ptr() with anything
        return type(got) is torch.Tensor and got.data_ptr() == expected.data_ptr() and got.shape == expected.shape
    return got is expected


def _explain(field: str, got: Any, name: str, context: ForwardContext) -> str:
    """Why `got` is not this layer's `field`, as a rule and a hint (never the object it should be)."""
    metadata, slots, layers = context.attn_metadata, context.slot_mapping, context.no_compile_layers
    assert not isinstance(metadata, list)  # the exercise's contexts hold one dict (no micro-batches)
    if field == "attn_metadata" and metadata is None:
        return "this context has no metadata at all (a profile run: attn_metadata is None), so the lookup gives None"
    if field == "attn_metadata" and got is metadata:
        return "you returned the whole attn_metadata dict; the context holds one entry per layer name"
    if field == "slot_mapping" and got is slots:
        return "you returned the whole slot_mapping dict; the context holds one entry per layer name"
    if field == "attn_metadata" and metadata is not None and any(got is m for m in metadata.values()):
        return "that is the metadata of another attention group's layers; look this layer's name up"
    if field == "slot_mapping" and any(_same(got, s) for s in slots.values()):
        return (
            "that is the slot mapping of a layer in another KV cache group (each group has its own slots); "
            "look this layer's name up"
        )
    if field == "slot_mapping" and name not in slots:
        return "this context has no slot mapping for this layer: the lookup gives None then (dict.get), not an error"
    if field == "layer" and any(got is layer for layer in layers.values()):
        return f"that is the layer registered as {getattr(got, 'layer_name', '?')!r}, not the one named {name!r}"
    if field == "layer":
        return "the layer is the object registered under the name in the context's no_compile_layers"
    if field == "kv_cache" and isinstance(got, torch.Tensor):
        return (
            "a tensor, but not this layer's cache: the runner bound the cache to the layer object at start-up "
            "(the context does not carry caches)"
        )
    return f"got {type(got).__name__}: look it up in the forward context (get_forward_context())"


def _worked_lookup(call: _Call) -> str:
    """The lookup of `call`, step by step, with what each step finds."""
    context, name = call.context, call.name
    layer = context.no_compile_layers[name]
    by_layer = context.attn_metadata
    assert not isinstance(by_layer, list)  # the exercise's contexts hold one dict (no micro-batches)
    if by_layer is None:
        metadata = "None: this is a profile run (attn_metadata is None), so the metadata is None"
    else:
        entry = by_layer[name]
        sharing = [n for n, m in by_layer.items() if m is entry]
        metadata = f"a {type(entry).__name__} object, the very one of layers {sharing}"
    slots = context.slot_mapping.get(name)
    slot_text = (
        "None: the context has no slot mapping for this layer" if slots is None else f"the tensor {slots.tolist()}"
    )
    return "\n".join(
        [
            f"In {call.where}, for layer_name = {name!r}:",
            "  ctx = get_forward_context()",
            f"  attn_metadata = ctx.attn_metadata[layer_name] if ctx.attn_metadata is not None else None  -> {metadata}",
            f"  layer = ctx.no_compile_layers[layer_name]  -> {type(layer).__name__} {name!r}",
            f"  kv_cache = layer.kv_cache  -> a tensor of shape {list(layer.kv_cache.shape)}",
            f"  slot_mapping = ctx.slot_mapping.get(layer_name)  -> {slot_text}",
            "  return attn_metadata, layer, kv_cache, slot_mapping",
        ]
    )
