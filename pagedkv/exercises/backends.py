"""Checker for notebook 04 (attention backends): "write your own backend".

`check_backend(MyBackend)` first calls your builder and impl directly, on batches, head
geometries (GQA ratios 3 and 5, MQA, MHA), head sizes, block sizes, sliding windows and scrambled
block tables that it makes up and no package test uses, two steps each (prefills, then decodes and
chunks on top of what your impl cached). Then it registers the backend and serves two prompts on
"tiny-hybrid" with it (layers 0 and 2 see only the last 32 positions; one prompt is longer).
Every attention output is compared with attention worked out inside the checker in float64,
after your code has run. An impl that inherits its work (forward, do_kv_cache_update) from a
built-in impl, or calls into one on any thread, is turned away. When outputs differ, the checker
looks at *which* rows and heads differ and names the usual cause:

    the step's K/V are not in their slots after the step          -> cache write
    the right values came back in a new tensor                    -> `output` not written in place
    some query heads right, others wrong                          -> GQA head mapping
    only earlier rows of a prompt differ, its last row is right   -> no causal mask
    only requests with cached context differ                      -> block table read / mask offset
    only rows whose window excludes early keys, in a window layer -> the sliding window
"""

from __future__ import annotations

import functools
import random
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionType, CommonAttentionMetadata
from pagedkv.attention.selector import backend_report, register_backend
from pagedkv.config import EngineConfig, ModelConfig
from pagedkv.engine.events import StepEvent
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, exercise, plain, used_package, watch_calls
from pagedkv.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.platforms import default_device

MODEL = "tiny-hybrid"
_BUILTIN_NAMES = ("TORCH_REF", "TRITON_ATTN", "FLASH_ATTN", "TORCH_REF_MLA", "TRITON_MLA")
_BUILTIN_MODULES = tuple(f"pagedkv.attention.backends.{m}" for m in ("torch_ref", "triton_attn", "flash_attn"))
_WORK_METHODS = ("forward", "do_kv_cache_update")
_ATOL = 1e-4

# Two prompts of different lengths and a small token budget, so that the engine's steps mix a
# prefill from scratch, prefill chunks on top of cached context, and decodes; the second
# prompt is longer than the sliding window (32) of layers 0 and 2.
_PROMPTS: list[list[int]] = [
    [(7 * i + 3) % 250 for i in range(11)],
    [(5 * i + 1) % 250 for i in range(41)],
]
_ENGINE_KWARGS: dict[str, Any] = {
    "block_size": 4,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
    "dtype": torch.float32,
    "enable_prefix_caching": False,
    # Eager: the hooks below must run in every step, and a replayed CUDA graph runs no Python (notebook 08).
    "enforce_eager": True,
}
_QUERY_POSITIONS = (
    "query row i of a request sits at position seq_len - query_len + i, so a mask aligned to the "
    "top-left corner (like scaled_dot_product_attention's is_causal=True) is wrong when query_len < seq_len."
)


def selector_report(llm: LLM, layer_name: str) -> dict[str, list[str]]:
    """Every registered backend -> its reasons for rejecting `layer_name` of `llm` (empty = usable)."""
    layer = llm.runner.attn_layers[layer_name]
    return backend_report(llm.config.device, **layer.selector_kwargs())


@dataclass
class _Geometry:
    """One made-up layer: heads, head size, window, and the cache it reads."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None
    num_blocks: int


@dataclass
class _StudentStep:
    """One step of the student's attention, as the checker saw it (what is needed to judge it afterwards)."""

    where: str
    context_lens: list[int]
    query_lens: list[int]
    query: torch.Tensor
    """[tokens, heads, head_size] as given."""
    keys: list[torch.Tensor]
    """Per request: the keys of all its positions so far, [seq_len, kv_heads, head_size]."""
    values: list[torch.Tensor]
    scale: float
    sliding_window: int | None
    output: torch.Tensor | None = None
    """What ended up in `output` (None: not recorded, the step failed before)."""
    returned: torch.Tensor | None = None
    """What forward returned, when that was not the `output` it was given."""
    cache_error: str = ""


@dataclass
class _Layer:
    """What an impl may read from the layer that calls it."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float = 1.0


def _made_up_geometries() -> list[_Geometry]:
    """GQA 3:1, MQA 5:1 with a window, MHA with a short window: shapes no model or test here uses."""
    return [
        _Geometry(6, 2, 12, 3, None, 40),
        _Geometry(5, 1, 20, 5, 9, 40),
        _Geometry(4, 4, 8, 7, 4, 40),
    ]


# (context_lens, query_lens) of each case's two steps: prefills of three requests, then (decodes
# first, as the runner orders a batch) a decode and two chunks on top of what the first step cached.
# Fixed, so that a message reads the same on every run; the tensors and block tables are random.
_MADE_UP_STEPS = [
    [([0, 0, 0], [2, 10, 15]), ([2, 10, 15], [1, 4, 11])],
    [([0, 0, 0], [1, 7, 13]), ([1, 7, 13], [1, 3, 9])],
    [([0, 0, 0], [3, 6, 12]), ([3, 6, 12], [1, 2, 10])],
]


def _watched(fn: Callable[..., Any], called: list[str]) -> Callable[..., Any]:
    """`fn` (the student's code), watched for calls of the built-in backends' work while it runs:
    only the student's code is watched, not the engine around it."""
    work = _builtin_work()

    def run(*args: Any, **kwargs: Any) -> Any:
        with watch_calls(work) as seen:
            try:
                return fn(*args, **kwargs)
            finally:
                called.extend(n for n in seen if n not in called)

    return run


def _call_student(
    backend: type[AttentionBackend],
    impl_cls: type,
    builder_cls: type,
    rng: random.Random,
    device: torch.device,
    called: list[str],
) -> tuple[list[_StudentStep], str | None]:
    """Run the student's builder and impl on the made-up cases; (the steps, a failure message or None).

    What a step is judged on is kept on the CPU (copies: the student's code may change its tensors later).
    """
    steps: list[_StudentStep] = []
    for number, (g, schedule) in enumerate(zip(_made_up_geometries(), _MADE_UP_STEPS), start=1):
        scale = g.head_size**-0.5
        config = EngineConfig(ModelConfig("sandbox"))
        impl = _watched(impl_cls, called)(
            g.num_heads, g.head_size, scale, g.num_kv_heads, g.sliding_window, torch.float32, AttentionType.DECODER
        )
        spec_args = (g.block_size, g.num_kv_heads, g.head_size, torch.float32)
        spec = (
            SlidingWindowSpec(*spec_args, sliding_window=g.sliding_window)
            if g.sliding_window
            else FullAttentionSpec(*spec_args)
        )
        builder = _watched(builder_cls, called)(spec, ["made.up.attn"], config, device)
        layer = _Layer("made.up.attn", g.num_heads, g.num_kv_heads, g.head_size, scale)
        kv_cache = torch.randn(
            backend.get_kv_cache_shape(g.num_blocks, g.block_size, g.num_kv_heads, g.head_size), device=device
        )
        # Scrambled physical blocks, never the null block 0, no two requests sharing one.
        blocks = rng.sample(range(1, g.num_blocks), g.num_blocks - 1)
        rows = [blocks[i::3] for i in range(3)]
        history_k: list[list[torch.Tensor]] = [[], [], []]
        history_v: list[list[torch.Tensor]] = [[], [], []]
        window = f", sliding window {g.sliding_window}" if g.sliding_window else ""
        for step_number, (context_lens, query_lens) in enumerate(schedule, start=1):
            where = (
                f"Made-up case {number} ({g.num_heads} query heads, {g.num_kv_heads} KV head(s) of size "
                f"{g.head_size}, block size {g.block_size}{window}), step {step_number}"
            )
            n = sum(query_lens)
            query = torch.randn(n, g.num_heads, g.head_size, device=device)
            key = torch.randn(n, g.num_kv_heads, g.head_size, device=device)
            value = torch.randn(n, g.num_kv_heads, g.head_size, device=device)
            slots, start = [], 0
            for i, (c, q) in enumerate(zip(context_lens, query_lens)):
                slots += [rows[i][p // g.block_size] * g.block_size + p % g.block_size for p in range(c, c + q)]
                history_k[i].append(key[start : start + q].to("cpu", copy=True))
                history_v[i].append(value[start : start + q].to("cpu", copy=True))
                start += q
            starts = torch.tensor([0] + [sum(query_lens[: i + 1]) for i in range(3)], dtype=torch.int32)
            seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
            width = max(len(r) for r in rows)
            common = CommonAttentionMetadata(
                query_start_loc=starts.to(device),
                query_start_loc_cpu=starts,
                seq_lens=seq_lens.to(device),
                seq_lens_cpu=seq_lens,
                num_reqs=3,
                num_actual_tokens=n,
                max_query_len=max(query_lens),
                max_seq_len=int(seq_lens.max()),
                block_table_tensor=torch.tensor(
                    [r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device
                ),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            )
            step = _StudentStep(
                where,
                list(context_lens),
                list(query_lens),
                query.to("cpu", copy=True),
                [torch.cat(h) for h in history_k],
                [torch.cat(h) for h in history_v],
                scale,
                g.sliding_window,
            )
            steps.append(step)
            before = kv_cache.clone()
            output = torch.zeros_like(query)
            try:
                metadata = _watched(builder.build, called)(common)
                if not backend.forward_includes_kv_cache_update:
                    _watched(impl.do_kv_cache_update, called)(layer, key, value, kv_cache, common.slot_mapping)
                result = _watched(impl.forward, called)(layer, query, key, value, kv_cache, metadata, output)
            except Exception as exc:  # noqa: BLE001  (the student's code may fail anywhere; say where)
                if called:
                    return steps, None
                first_line = (str(exc).splitlines() or [""])[0]
                return steps, f"{where}: your backend raised {type(exc).__name__}: {first_line}"
            for name, tensor in (("output", output), ("kv_cache", kv_cache)):
                try:  # exactly a tensor still: a class given to it could make the torch ops below lie
                    plain(tensor, query)
                except TypeError:
                    return steps, (
                        f"{where}: your backend made `{name}` a {type(tensor).__name__}; write into the "
                        "tensors the engine passes, as they are"
                    )
            step.output = output.detach().to("cpu", copy=True)
            if type(result) is torch.Tensor and result.data_ptr() != output.data_ptr():  # a subclass: ignored
                step.returned = result.detach().to("cpu", copy=True)
            step.cache_error = _cache_write_error(kv_cache, before, key, value, common.slot_mapping)
    return steps, None


def _cache_write_error(
    cache: torch.Tensor, before: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> str:
    """What is wrong with the cache after a step ("" if right or not the default layout).

    Only the default layout (2, num_blocks, block_size, num_kv_heads, head_size) is checked: the
    step's K/V must be in their slots, and no other slot may have changed.
    """
    if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != tuple(key.shape[1:]):
        return ""
    flat, old = cache.view(2, -1, *key.shape[1:]), before.view(2, -1, *key.shape[1:])
    for index, which, new in ((0, "key", key), (1, "value", value)):
        wrong = ~torch.isclose(flat[index, slot_mapping], new, atol=_ATOL, rtol=1e-3).flatten(1).all(dim=1)
        if wrong.any():
            token = int(wrong.nonzero()[0, 0])
            return (
                f"after the step, the slot of token {token} (slot_mapping[{token}]) does not hold its {which}. "
                "Write token t's key into kv_cache[0] and its value into kv_cache[1], at flat slot "
                "slot_mapping[t] of the (num_blocks * block_size) token rows, and skip slots of -1."
            )
    others = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    others[slot_mapping] = False
    if not torch.equal(flat[:, others], old[:, others]):
        return (
            "slots that are not this step's changed: write only at slot_mapping's slots "
            "(slot = block * block_size + offset; block b holds slots b * block_size ... "
            "b * block_size + block_size - 1)."
        )
    return ""


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
        if module is None:
            continue
        for obj in vars(module).values():
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


def _serve(
    name: str, device: torch.device | str | None, called: list[str]
) -> tuple[list[_StudentStep], dict[str, str]]:
    """Serve the checker's prompts with backend `name`, recording what every attention layer got and gave."""
    llm = LLM(MODEL, attention_backend=name, device=device, **_ENGINE_KWARGS)
    layers = llm.runner.attn_layers
    for layer in layers.values():
        if layer.attn_backend.get_name() == name:
            for method in _WORK_METHODS:
                setattr(layer.impl, method, _watched(getattr(layer.impl, method), called))
    for groups in llm.runner.attn_groups:
        for group in groups:
            if group.backend.get_name() == name:
                builder = group.metadata_builder
                assert builder is not None  # made with the KV cache, before the first step
                # Instrumented on purpose, this engine's builder only (mypy refuses assigning to a method).
                builder.build = _watched(builder.build, called)  # type: ignore[method-assign]
    steps: list[_StudentStep] = []
    seen: dict[str, tuple[torch.Tensor, ...]] = {}  # this step: layer name -> (query, key, value, output)
    histories: dict[tuple[str, str], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def record_inputs(module: Any, args: tuple[Any, ...]) -> None:
        seen[module.layer_name] = tuple(a.detach().to("cpu", torch.float32, copy=True) for a in args)

    def record_output(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seen[module.layer_name] += (output.detach().to("cpu", torch.float32, copy=True),)

    def record_step(event: StepEvent) -> None:
        batch = event.result.batch
        starts = batch.query_start_loc_cpu.tolist()
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        context_lens = [s - q for s, q in zip(batch.seq_lens_cpu.tolist(), query_lens)]
        for layer_name, (query, key, value, output) in seen.items():
            layer = layers[layer_name]
            heads, kv_heads, size = layer.num_heads, layer.num_kv_heads, layer.head_size
            key, value = key.view(-1, kv_heads, size), value.view(-1, kv_heads, size)
            keys, values = [], []
            for rid, a, b in zip(batch.req_ids, starts, starts[1:]):
                past_k, past_v = histories.setdefault((layer_name, rid), ([], []))
                past_k.append(key[a:b])
                past_v.append(value[a:b])
                keys.append(torch.cat(past_k))
                values.append(torch.cat(past_v))
            steps.append(
                _StudentStep(
                    f"Step {event.step} of {MODEL!r}, layer {layer_name!r}",
                    context_lens,
                    query_lens,
                    query.view(-1, heads, size),
                    keys,
                    values,
                    layer.scale,
                    layer.sliding_window,
                    output=output.view(-1, heads, size),
                )
            )
        seen.clear()

    hooks = [layer.register_forward_pre_hook(record_inputs) for layer in layers.values()]
    hooks += [layer.register_forward_hook(record_output) for layer in layers.values()]
    llm.add_step_listener(record_step)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    return steps, {n: layer.attn_backend.get_name() for n, layer in layers.items()}


@exercise("04: a backend of your own")
def check_backend(backend: Any, device: torch.device | str | None = None) -> CheckResult:
    """Run your builder and impl on made-up batches, then serve "tiny-hybrid" with your backend, and
    compare every attention output with float64 attention worked out by the checker afterwards.

    `backend` is your `AttentionBackend` subclass (the class itself, not an instance); it is registered.
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
    if name in _BUILTIN_NAMES:
        return CheckResult(False, f"{name!r} is a built-in backend's name; give yours a name of its own.")
    inherited = _inherited_work(impl_cls)
    if inherited is not None:
        return CheckResult(
            False,
            f"Your impl {impl_cls.__name__} inherits the {inherited} (a built-in backend); "
            "write forward (and do_kv_cache_update if you use it) yourself.",
        )
    register_backend(backend)
    torch_device = torch.device(device) if device is not None else default_device()
    called: list[str] = []
    steps, failure = _call_student(backend, impl_cls, builder_cls, random.Random(), torch_device, called)
    backend_names: dict[str, str] = {}
    if failure is None and not called:
        try:
            served, backend_names = _serve(name, device, called)
            steps += served
        except Exception as exc:  # noqa: BLE001  (the student's code may fail anywhere; say where)
            failure = (
                f"Serving {MODEL!r} with {name} failed: {type(exc).__name__}: {exc}. "
                f"(impl {impl_cls.__name__}, builder {builder_cls.__name__}.)"
            )
    if called:
        return used_package(called, "the attention")

    # Your code has run: only now is the attention worked out, in float64.
    def attend(step: _StudentStep, request: int) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v of one request: [query_len, heads, head_size], float64."""
        context_len, query_len = step.context_lens[request], step.query_lens[request]
        start = sum(step.query_lens[:request])
        q = step.query[start : start + query_len].double()
        group = q.shape[1] // step.keys[request].shape[1]
        k = step.keys[request].double().repeat_interleave(group, dim=1)
        v = step.values[request].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(context_len, context_len + query_len)[:, None]
        k_pos = torch.arange(context_len + query_len)[None, :]
        visible = k_pos <= q_pos
        if step.sliding_window is not None:
            visible &= q_pos - k_pos < step.sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)

    for step in steps:
        if step.output is None:
            break
        if step.cache_error:
            return CheckResult(
                False,
                f"{step.where}: the KV cache write is wrong: {step.cache_error}",
                reveal=functools.partial(_worked_cache_write, step),
            )
        right = torch.cat([attend(step, i) for i in range(len(step.query_lens))])
        if step.output.shape != right.shape:
            return CheckResult(
                False,
                f"{step.where}: the output has shape {tuple(step.output.shape)}, not the "
                "query's [tokens, num_heads, head_size].",
            )
        if not torch.isfinite(step.output).all() or not torch.allclose(
            step.output.double(), right, atol=_ATOL, rtol=1e-3
        ):
            return CheckResult(False, _diagnose(step, right), reveal=functools.partial(_worked_step, step, right))
    if failure is not None:
        return CheckResult(False, failure + ".")
    not_used = sorted(n for n, b in backend_names.items() if b != name)
    if not_used:
        return CheckResult(
            False,
            f"The engine did not use {name} for layers {not_used}: check that your "
            "backend class accepts those layers (supported_devices, dtypes, sliding window).",
        )
    made_up = sum(s.where.startswith("Made-up") for s in steps)
    return CheckResult(
        True,
        f"{name} is right in all {made_up} made-up steps (GQA 3:1, MQA with a window, MHA with a short window) "
        f"and in all {len(steps) - made_up} layer calls of {MODEL!r} (two layers with a sliding window; prefills, "
        "chunks on cached context, decodes): every output matches float64 attention.",
    )


def _diagnose(step: _StudentStep, right: torch.Tensor) -> str:
    """Name the most likely cause of a difference in one step's output (never the right values)."""
    got = step.output.double()  # type: ignore[union-attr]
    where = f"{step.where} ({_describe(step)})"
    if not torch.isfinite(got).all():
        return (
            f"{where}: the output contains NaN or inf. A fully masked row gives softmax(-inf, ...) = NaN: "
            "check that every query sees at least itself (its own key is at position seq_len - query_len + i)."
        )
    diff = (got - right).abs()
    bad_row = diff.amax(dim=(1, 2)) > _ATOL  # [tokens]
    bad_head = diff.amax(dim=(0, 2)) > _ATOL  # [heads]
    starts = [0]
    for q in step.query_lens:
        starts.append(starts[-1] + q)
    bad_reqs = [i for i in range(len(step.query_lens)) if bad_row[starts[i] : starts[i + 1]].any()]
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(step.context_lens, step.query_lens)])
    where += f": {int(bad_row.sum())} of {len(bad_row)} token rows are wrong."
    window = step.sliding_window
    if window is not None and bool((positions[bad_row] >= window).all()):
        cause = (
            f"Only rows whose query sits at position {window} or later are wrong, and this layer has a sliding "
            f"window of {window} (impl.sliding_window): a query at position p sees only keys at positions "
            f"p - {window - 1} ... p. Mask the older keys too."
        )
    elif (
        step.returned is not None
        and step.returned.shape == right.shape
        and torch.allclose(step.returned.double(), right, atol=_ATOL, rtol=1e-3)
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
    elif bad_reqs and all(
        not bad_row[starts[i + 1] - 1] and bad_row[starts[i] : starts[i + 1] - 1].any() for i in bad_reqs
    ):
        cause = (
            "In each wrong request only the earlier query rows differ; its last row is right. "
            "The last query token may see every key, the others must not see later ones: "
            "apply the causal mask (key position <= query position)."
        )
    elif bad_reqs and all(step.context_lens[i] > 0 for i in bad_reqs) and any(c == 0 for c in step.context_lens):
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


def _describe(step: _StudentStep) -> str:
    parts = []
    for i, (c, q) in enumerate(zip(step.context_lens, step.query_lens)):
        kind = "decode" if q == 1 and c > 0 else ("prefill chunk" if c > 0 else "prefill")
        parts.append(f"request {i}: {kind}, context_len {c}, query_len {q}")
    return "; ".join(parts)


def _worked_step(step: _StudentStep, right: torch.Tensor) -> str:
    """How the first wrong row of a step is worked out, with its numbers (head 0, first 4 values)."""
    got = step.output.double()  # type: ignore[union-attr]
    row = int(((got - right).abs().amax(dim=(1, 2)) > _ATOL).nonzero()[0, 0]) if torch.isfinite(got).all() else 0
    request = next(i for i in range(len(step.query_lens)) if row < sum(step.query_lens[: i + 1]))
    context_len, query_len = step.context_lens[request], step.query_lens[request]
    position = context_len + row - sum(step.query_lens[:request])
    group = step.query.shape[1] // step.keys[request].shape[1]
    oldest = 0 if step.sliding_window is None else max(position - step.sliding_window + 1, 0)
    return "\n".join(
        [
            f"{step.where}, token row {row}: request {request} (context_len {context_len}, query_len {query_len}).",
            f"  the row's query sits at position context_len + {row - sum(step.query_lens[:request])} = {position}",
            f"  it sees keys at positions {oldest} ... {position}"
            + (f" (causal, and the window of {step.sliding_window})" if step.sliding_window else " (causal)"),
            f"  query head h reads KV head h // {group} (num_heads // num_kv_heads = {group})",
            f"  scores = q . k * {step.scale:.4g} over those keys, softmax over the keys, then the weighted sum of V",
            f"  row {row}, head 0 should start {[round(x, 4) for x in right[row, 0, :4].tolist()]}; "
            f"yours starts {[round(x, 4) for x in got[row, 0, :4].tolist()]}",
        ]
    )


def _worked_cache_write(step: _StudentStep) -> str:
    """Where the step's new keys and values go, token by token (the first 4 tokens)."""
    return "\n".join(
        [
            f"{step.where}: each new token t goes to slot = slot_mapping[t] = block * block_size + offset, where",
            "  block = block_table[i, position // block_size] and offset = position % block_size for its request i",
            "  k_cache, v_cache = kv_cache.unbind(0); k_cache.view(-1, num_kv_heads, head_size)[slot] = key[t]",
            "  v_cache.view(-1, num_kv_heads, head_size)[slot] = value[t]; slots of -1 are padding: skip them",
            "  nothing else in the cache changes.",
        ]
    )
