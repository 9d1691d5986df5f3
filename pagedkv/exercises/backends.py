"""Checkers for notebook 04 (attention backends): "write your own backend".

`check_backend(MyBackend)` registers the class, serves the same greedy requests with it and
with TORCH_REF (the oracle) on "tiny-hybrid" (layers 0 and 2 see only the last 32 positions, and
one prompt is longer than that: the notebook's NAIVE backend ignores the window and fails), and
compares every attention layer's output in every step. A backend whose impl inherits its work
(forward, do_kv_cache_update) from a built-in impl, or calls into one, is turned away. When the
outputs differ, it looks at *which* rows and heads differ and names the usual cause:

    the step's K/V are not in their slots after the step          -> cache write
    the right values came back in a new tensor                    -> `output` not written in place
    some query heads right, others wrong                          -> GQA head mapping
    only earlier rows of a prompt differ, its last row is right   -> no causal mask
    only requests with cached context differ                      -> block table read / mask offset
    only rows whose window excludes early keys, in a window layer -> the sliding window
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sys
import types

import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.layer import Attention
from pagedkv.attention.selector import backend_report, register_backend
from pagedkv.engine.events import StepEvent
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, used_package, watch_calls
from pagedkv.exercises.attention_groups import step_lengths

REFERENCE_BACKEND = "TORCH_REF"
MODEL = "tiny-hybrid"
_BUILTIN_MODULES = tuple(f"pagedkv.attention.backends.{m}" for m in ("torch_ref", "triton_attn", "flash_attn"))
_WORK_METHODS = ("forward", "do_kv_cache_update")

# Two prompts of different lengths and a small token budget, so that the steps mix a
# prefill from scratch, prefill chunks on top of cached context, and decodes; the second
# prompt is longer than the sliding window (32) of layers 0 and 2.
_PROMPTS: list[list[int]] = [
    [(7 * i + 3) % 250 for i in range(11)],
    [(5 * i + 1) % 250 for i in range(41)],
]
_ENGINE_KWARGS: dict[str, Any] = {
    "block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16, "dtype": torch.float32,
    # Eager: the hooks and the wrapped impl.forward below must run in every step, and a replayed
    # CUDA graph runs no Python (notebook 08).
    "enforce_eager": True,
}
_MAX_TOKENS = 5
_ATOL = 1e-4
_QUERY_POSITIONS = (
    "query row i of a request sits at position seq_len - query_len + i, so a mask aligned to the "
    "top-left corner (like scaled_dot_product_attention's is_causal=True) is wrong when query_len < seq_len."
)


def selector_report(llm: LLM, layer_name: str) -> dict[str, list[str]]:
    """Every registered backend -> its reasons for rejecting `layer_name` of `llm` (empty = usable)."""
    layer = llm.runner.attn_layers[layer_name]
    return backend_report(llm.config.device, **layer.selector_kwargs())


@dataclass
class StepRecord:
    """One engine step as the checker saw it: the batch and each layer's attention output."""

    step: int
    req_ids: list[str]
    context_lens: list[int]
    query_lens: list[int]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Layer name -> attention output [tokens, num_heads, head_size] (before o_proj), on the CPU."""
    cache_errors: dict[str, str] = field(default_factory=dict)
    """Layer name -> what is wrong with the K/V found in this step's slots after the step."""
    returned: dict[str, torch.Tensor] = field(default_factory=dict)
    """Layer name -> what impl.forward returned, when that was not the `output` it was given."""

    def describe(self) -> str:
        parts = []
        for rid, ctx, q in zip(self.req_ids, self.context_lens, self.query_lens):
            kind = "decode" if q == 1 and ctx > 0 else ("prefill chunk" if ctx > 0 else "prefill")
            parts.append(f"request {rid}: {kind}, context_len {ctx}, query_len {q}")
        return "; ".join(parts)


@dataclass
class BackendRun:
    """Everything one engine run with one backend produced."""

    backend_names: dict[str, str]
    tokens: list[list[int]]
    steps: list[StepRecord]
    sliding_windows: dict[str, int | None] = field(default_factory=dict)
    """Layer name -> its sliding window (None: it sees the whole sequence)."""


_reference_runs: dict[str, BackendRun] = {}


def reference_run(device: torch.device | str | None = None) -> BackendRun:
    """`run_backend(TORCH_REF)`, computed once per device and session."""
    key = str(device)
    if key not in _reference_runs:
        _reference_runs[key] = run_backend(REFERENCE_BACKEND, device)
    return _reference_runs[key]


def run_backend(name: str, device: torch.device | str | None = None) -> BackendRun:
    """Serve the checker's prompts greedily with backend `name`, recording every attention output."""
    llm = LLM(MODEL, attention_backend=name, device=device, **_ENGINE_KWARGS)
    steps: list[StepRecord] = []
    # What the current step produced so far, per layer name; moved into a StepRecord after the step.
    outputs: dict[str, torch.Tensor] = {}
    new_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    returned: dict[str, torch.Tensor] = {}

    def record_kv(module: Attention, args: tuple[Any, ...]) -> None:
        _, key, value = args
        new_kv[module.layer_name] = (key.detach().clone(), value.detach().clone())

    def record_output(module: Attention, args: tuple[Any, ...], output: torch.Tensor) -> None:
        outputs[module.layer_name] = output.detach().view(-1, module.num_heads, module.head_size).float().cpu()

    def watch_return(layer_name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap impl.forward to keep what it returns when that is not the `output` it was given."""
        def forward_and_watch(layer: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            output = args[4] if len(args) > 4 else kwargs["output"]
            # The engine's `output` is uninitialised memory: zeroed, rows the impl leaves unwritten
            # read 0 (diagnosed as such), not whatever was there (sometimes NaN, diagnosed as a mask bug).
            output.zero_()
            result = forward(layer, query, *args, **kwargs)
            if isinstance(result, torch.Tensor) and result.data_ptr() != output.data_ptr():
                returned[layer_name] = result.detach().float().cpu()
            return result

        return forward_and_watch

    def record_step(event: StepEvent) -> None:
        lengths = step_lengths(event)
        record = StepRecord(
            event.step, list(event.result.batch.req_ids), lengths["context_lens"], lengths["query_lens"],
            dict(outputs), returned=dict(returned),
        )
        for layer_name, (key, value) in new_kv.items():
            error = cache_write_error(
                llm.runner.attn_layers[layer_name], key, value, event.result.slot_mapping[layer_name]
            )
            if error:
                record.cache_errors[layer_name] = error
        steps.append(record)
        outputs.clear()
        new_kv.clear()
        returned.clear()

    layers = llm.runner.attn_layers
    for layer_name, layer in layers.items():
        layer.impl.forward = watch_return(layer_name, layer.impl.forward)
    hooks = [layer.register_forward_hook(record_output) for layer in layers.values()]
    hooks += [layer.register_forward_pre_hook(record_kv) for layer in layers.values()]
    llm.add_step_listener(record_step)
    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, ignore_eos=True)
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params)
    finally:
        for hook in hooks:
            hook.remove()
    return BackendRun(
        {n: layer.attn_backend.get_name() for n, layer in layers.items()},
        [r.outputs[0].token_ids for r in results],
        steps,
        {n: layer.impl.sliding_window for n, layer in layers.items()},
    )


def cache_write_error(layer: Attention, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> str:
    """What is wrong with the new K/V in `layer`'s cache after a step ("" if right or not checkable).

    Only the default layout (2, num_blocks, block_size, num_kv_heads, head_size) is checked.
    """
    cache = layer.kv_cache
    if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (layer.num_kv_heads, layer.head_size):
        return ""
    flat = cache.view(2, -1, layer.num_kv_heads, layer.head_size)
    n = slot_mapping.shape[0]
    tokens = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[tokens]
    for index, which, new in ((0, "key", key), (1, "value", value)):
        expected = new[:n].view(n, layer.num_kv_heads, layer.head_size)[tokens].float()
        wrong = ~torch.isclose(flat[index, slots].float(), expected, atol=_ATOL, rtol=1e-3).flatten(1).all(dim=1)
        if wrong.any():
            token = int(tokens[wrong.nonzero()[0, 0]])
            slot = int(slot_mapping[token])
            return (
                f"after the step, slot {slot} does not hold the {which} of token {token} "
                f"(slot_mapping[{token}] = {slot}). Write token t's key into kv_cache[0] and its value "
                "into kv_cache[1], at flat slot slot_mapping[t] of the (num_blocks * block_size) "
                "token rows, and skip slots of -1."
            )
    return ""


def _query_positions(step: StepRecord) -> torch.Tensor:
    """The position of every query row of the step: request i's rows are its last query_len positions."""
    return torch.cat([torch.arange(c, c + q) for c, q in zip(step.context_lens, step.query_lens)])


def _diagnose(step: StepRecord, layer: str, got: torch.Tensor, ref: torch.Tensor, window: int | None) -> str:
    """Name the most likely cause of a difference in one layer's output of one step."""
    diff = (got - ref).abs()
    if not torch.isfinite(got).all():
        cause = (
            "the output contains NaN or inf. A fully masked row gives softmax(-inf, ...) = NaN: "
            "check that every query sees at least itself (its own key is at position seq_len - query_len + i)."
        )
        return f"Step {step.step}, layer {layer!r} ({step.describe()}): {cause}"
    bad_row = diff.amax(dim=(1, 2)) > _ATOL  # [tokens]
    bad_head = diff.amax(dim=(0, 2)) > _ATOL  # [heads]
    starts = [0]
    for q in step.query_lens:
        starts.append(starts[-1] + q)
    bad_reqs = [i for i in range(len(step.query_lens)) if bad_row[starts[i] : starts[i + 1]].any()]
    where = (
        f"Step {step.step}, layer {layer!r}: max |yours - {REFERENCE_BACKEND}| = {diff.max().item():.3g} "
        f"in {int(bad_row.sum())} of {len(bad_row)} token rows ({step.describe()})."
    )
    result = step.returned.get(layer)
    if window is not None and bool((_query_positions(step)[bad_row] >= window).all()):
        cause = (
            f"Only rows whose query sits at position {window} or later are wrong, and this layer has a sliding "
            f"window of {window} (impl.sliding_window): a query at position p sees only keys at positions "
            f"p - {window - 1} ... p. Mask the older keys too."
        )
    elif result is not None and result.numel() == ref.numel() and torch.allclose(
        result.view_as(ref), ref, atol=_ATOL, rtol=1e-3
    ):
        cause = (
            "impl.forward returned the right values in a new tensor, but the engine reads the `output` "
            "tensor it passed in: write into it (output[...] = ..., or output.copy_(...))."
        )
    elif got[bad_row].abs().max() == 0:
        cause = (
            "The engine reads the `output` tensor it passed to impl.forward, and yours left rows "
            "of it unwritten: write every row of the result into `output`."
        )
    elif 0 < int(bad_head.sum()) < len(bad_head):
        good = (~bad_head).nonzero().flatten().tolist()
        bad = bad_head.nonzero().flatten().tolist()
        cause = (
            f"Query heads {good} are right but heads {bad} are wrong: query head h must read KV head "
            "h // (num_heads // num_kv_heads). Repeat each KV head for its query heads with "
            "repeat_interleave (0,0,1,1), not repeat (0,1,0,1)."
        )
    elif all(
        not bad_row[starts[i + 1] - 1] and bad_row[starts[i] : starts[i + 1] - 1].any()
        for i in bad_reqs
    ) and bad_reqs:
        cause = (
            "In each wrong request only the earlier query rows differ; its last row is right. "
            "The last query token may see every key, the others must not see later ones: "
            "apply the causal mask (key position <= query position)."
        )
    elif bad_reqs and all(step.context_lens[i] > 0 for i in bad_reqs) and any(
        step.context_lens[i] == 0 for i in range(len(step.query_lens))
    ):
        cause = (
            "Requests with no cached context are right, those that read earlier tokens from the "
            "cache are wrong. Check the read through the block table (logical block j of request i "
            f"is block_table[i, j]) and the causal mask: {_QUERY_POSITIONS}"
        )
    elif bad_reqs and all(step.context_lens[i] > 0 for i in bad_reqs):
        cause = (
            "Only requests that read cached tokens are wrong. Check the read through the block table, "
            f"that all seq_len keys (not just query_len) are attended to, and the causal mask: {_QUERY_POSITIONS}"
        )
    else:
        cause = (
            "Requests of every kind are wrong. Check the scale (impl.scale = 1/sqrt(head_size)), that the "
            "softmax runs over the key axis, and that V is weighted by the probabilities."
        )
    return f"{where} {cause}"


def _builtin_work() -> list[Callable[..., Any]]:
    """The built-in backends' work: their impls' forward / do_kv_cache_update, their module
    functions, and the Triton kernels' entry points (`pagedkv.kernels`).

    Only modules already imported are looked at (importing triton_attn here would import triton).
    """
    kernels = sys.modules.get("pagedkv.kernels")
    work: list[Callable[..., Any]] = [
        getattr(kernels, n) for n in ("unified_attention", "reshape_and_cache") if kernels is not None
    ]
    for module in (sys.modules.get(m) for m in _BUILTIN_MODULES):
        for obj in vars(module).values() if module is not None else ():
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # imported from elsewhere (torch, the backend base classes)
            if isinstance(obj, types.FunctionType):
                work.append(obj)
            elif isinstance(obj, type):
                work += [f for n, f in vars(obj).items() if n in _WORK_METHODS and isinstance(f, types.FunctionType)]
    return work


def _inherited_work(impl_cls: type) -> str | None:
    """'forward of TorchRefImpl' when `impl_cls` gets a work method from a built-in backend's class, else None."""
    for method in _WORK_METHODS:
        owner = next((c for c in impl_cls.__mro__ if method in vars(c)), None)
        if owner is not None and owner.__module__ in _BUILTIN_MODULES:
            return f"{method} of {owner.__name__}"
    return None


def check_backend(backend: Any, device: torch.device | str | None = None) -> CheckResult:
    """Register `backend`, serve requests with it, and compare with TORCH_REF layer by layer.

    `backend` is your `AttentionBackend` subclass (the class itself, not an instance).
    Runs in float32 so that the comparison can be tight.
    """
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        return CheckResult(
            False,
            f"Expected an AttentionBackend subclass (the class itself), got {backend!r}. "
            "Subclass pagedkv.attention.backend.AttentionBackend and pass the class.",
        )
    try:
        name = backend.get_name()
        impl_cls, builder_cls = backend.get_impl_cls(), backend.get_builder_cls()
    except TypeError as exc:
        return CheckResult(
            False, f"The backend class is incomplete: {exc}. It needs get_name, get_impl_cls and get_builder_cls."
        )
    if name == REFERENCE_BACKEND or name in ("TRITON_ATTN", "FLASH_ATTN"):
        return CheckResult(False, f"{name!r} is a built-in backend's name; give yours a name of its own.")
    inherited = _inherited_work(impl_cls)
    if inherited is not None:
        return CheckResult(False, f"Your impl {impl_cls.__name__} inherits the {inherited} (a built-in backend); "
                                  "write forward (and do_kv_cache_update if you use it) yourself.")
    register_backend(backend)
    try:
        with watch_calls(_builtin_work()) as called:
            mine = run_backend(name, device)
    except Exception as exc:  # noqa: BLE001  (the student's code may fail anywhere; say where)
        if called:
            return used_package(called, "the attention")
        return CheckResult(
            False,
            f"Serving with {name} failed: {type(exc).__name__}: {exc}. "
            f"(impl {impl_cls.__name__}, builder {builder_cls.__name__}.)",
        )
    if called:
        return used_package(called, "the attention")
    not_used = sorted(n for n, b in mine.backend_names.items() if b != name)
    if not_used:
        return CheckResult(False, f"The engine did not use {name} for layers {not_used}: {mine.backend_names}.")
    ref = reference_run(device)
    for step_mine, step_ref in zip(mine.steps, ref.steps):
        # Layer by layer, so that the first wrong layer is named: its wrong output feeds the
        # later layers' keys and values (even garbage, from an `output` left unwritten).
        for layer, out_ref in step_ref.outputs.items():
            if layer in step_mine.cache_errors:
                error = step_mine.cache_errors[layer]
                return CheckResult(False, f"Step {step_mine.step}, layer {layer!r}: the KV cache write is wrong: {error}")
            out = step_mine.outputs.get(layer)
            if out is None or out.shape != out_ref.shape:
                shape = None if out is None else tuple(out.shape)
                return CheckResult(
                    False,
                    f"Step {step_ref.step}, layer {layer!r}: output shape {shape}, expected {tuple(out_ref.shape)}.",
                )
            if not torch.isfinite(out).all() or not torch.allclose(out, out_ref, atol=_ATOL, rtol=1e-3):
                window = ref.sliding_windows.get(layer)
                return CheckResult(False, _diagnose(step_mine, layer, out, out_ref, window))
    if mine.tokens != ref.tokens:
        return CheckResult(False, f"Attention outputs agree but greedy tokens differ: {mine.tokens} vs {ref.tokens}.")
    num_layers = len(mine.backend_names)
    return CheckResult(
        True,
        f"{name} served all {num_layers} layers of {MODEL} (two with a sliding window) for {len(mine.steps)} "
        f"steps (prefills, prefill chunks on cached context, decodes); every attention output matches "
        f"{REFERENCE_BACKEND} and so do the greedy tokens {mine.tokens}.",
    )
