"""Piecewise torch.compile on the CPU (`pagedkv.compilation`, issue 9 point 3).

The model's forward is traced once by Dynamo, split at the attention custom ops, and the
pieces run as traced Python ("eager" piece compiler: cheap enough for CI) with attention
run eagerly between them. Checked: where the split falls, that the compile work does not
grow with the number of layers, that new batch sizes do not recompile, and that the
engine's logits equal the eager engine's step by step.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import pagedkv.config
from pagedkv import LLM, SamplingParams
from pagedkv.compilation import (
    CompiledPiece,
    attention_compiled_piecewise,
    compile_model,
)
from pagedkv.compilation.split import op_name, structure_key
from pagedkv.config import CompilationConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedkv.forward_context import set_forward_context
from pagedkv.models.loader import PRESETS
from pagedkv.worker.model_runner import ModelRunner

KV_UPDATE = "pagedkv::unified_kv_cache_update"
ATTENTION = "pagedkv::unified_attention_with_output"


def _config(**compilation: Any) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model="tiny"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4),
        compilation_config=CompilationConfig(**compilation),
    )


def _runner(num_layers: int, **compilation: Any) -> ModelRunner:
    """A tiny Llama of `num_layers` layers, its forward compiled by the runner's hook."""
    model_config = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=num_layers)
    return ModelRunner(_config(compile=True, **compilation), model_config)


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def traced() -> dict[int, tuple[ModelRunner, int]]:
    """Runners of 2 and 6 layers after their profile run (which traces), with the number of
    Dynamo graphs each trace added."""
    # Dynamo remembers, per code object, which sizes changed between earlier compiles in this process
    # (other tests compile the same model forward) and can trace some inputs dynamic that a fresh
    # process traces static: the pieces' keys, and so what is counted here, could depend on test order.
    torch._dynamo.reset()
    runners = {}
    for num_layers in (2, 6):
        runner = _runner(num_layers)
        before = _unique_graphs()
        runner.profile_run()
        runners[num_layers] = (runner, _unique_graphs() - before)
    return runners


def _ops_called(graph: torch.fx.GraphModule) -> list[tuple[str, Any]]:
    """(op name, layer-name argument) of every torch.ops.pagedkv call in `graph`."""
    return [
        (op_name(node.target), node.args[-1])
        for node in graph.graph.nodes
        if node.op == "call_function" and (op_name(node.target) or "").startswith("pagedkv::")
    ]


def test_the_split_puts_each_attention_op_between_two_pieces(traced) -> None:
    runner, _ = traced[2]
    items = runner.compiled_forward.backend.items
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    expected = [
        None,
        (KV_UPDATE, layers[0]),
        (ATTENTION, layers[0]),
        None,
        (KV_UPDATE, layers[1]),
        (ATTENTION, layers[1]),
        None,
    ]
    seen = [tuple(_ops_called(item.graph)[0]) if item.is_splitting_op else None for item in items]
    assert seen == expected
    for item in items:
        if item.is_splitting_op:
            assert len(_ops_called(item.graph)) == 1  # the op alone
        else:
            assert _ops_called(item.graph) == []  # no attention inside a compiled piece
    first, last = items[0].graph.code, items[-1].graph.code
    assert "embedding" in first and "embedding" not in last  # the model's ends sit in the end pieces
    assert attention_compiled_piecewise(runner.config.compilation_config)


def test_compile_work_does_not_grow_with_the_number_of_layers(traced) -> None:
    """One Dynamo graph for the whole model, and the same pieces compiled, for 2 and 6 layers:
    the first piece, the one between two layers' attention (shared by all), and the last."""
    stats = {}
    for num_layers, (runner, dynamo_graphs) in traced.items():
        backend = runner.compiled_forward.backend
        stats[num_layers] = (dynamo_graphs, backend.num_graphs, backend.num_piece_compiles)
        assert len(backend.pieces) == num_layers + 1  # the work itself does scale
    assert stats[2] == stats[6] == (1, 1, 3)


def test_new_batch_sizes_do_not_recompile() -> None:
    """1-token batches run eagerly until the first trace, then every size reuses it."""
    runner = _runner(2)
    compiled = runner.compiled_forward
    before = _unique_graphs()
    for num_tokens in (1, 5, 1, 2, 17, 3):
        ids = torch.randint(0, 320, (num_tokens,))
        positions = torch.arange(num_tokens)
        with torch.inference_mode(), set_forward_context(None, runner.config):
            hidden = runner.model(ids, positions)
            reference = compiled.eager_forward(ids, positions)
        torch.testing.assert_close(hidden, reference)
        assert compiled.backend.num_graphs == (0 if not compiled.traced else 1)
    assert compiled.traced and compiled.backend.num_graphs == 1
    assert _unique_graphs() - before == 1
    # The compiled code lives on this model's private copy of forward's code object, not on
    # the one every LlamaForCausalLM shares (where engines would pile up to the recompile limit).
    assert _debug_get_cache_entry_list(type(runner.model).forward) == []


def _logits_per_step(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[torch.Tensor]:
    steps: list[torch.Tensor] = []
    detach = llm.add_step_listener(lambda event: steps.append(event.result.logits.clone()))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    detach()
    return steps


def test_compiled_engine_logits_equal_eager_logits() -> None:
    """Prefill, chunked prefill and decodes of 3, 2 and 1 requests: many batch sizes, one trace."""
    prompts = [list(range(1, 40)), list(range(50, 61)), [7, 8, 9]]
    max_tokens = [6, 4, 2]
    kwargs = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=32)
    eager = _logits_per_step(LLM("tiny", **kwargs), prompts, max_tokens)
    llm = LLM("tiny", **kwargs)
    compiled = compile_model(llm.runner.model, llm.config)
    steps = _logits_per_step(llm, prompts, max_tokens)
    assert len(steps) == len(eager) >= 6
    for got, want in zip(steps, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert compiled.backend.num_graphs == 1


def test_compile_with_no_engine_config_left_from_an_earlier_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: no engine config is current once the model is built, so a layer that
    asked for it in forward made Dynamo trace the construction of a default one (and fail)."""
    monkeypatch.setattr(pagedkv.config, "_current_config", None)
    prompts, max_tokens = [list(range(1, 20)), [7, 8, 9]], [3, 2]
    kwargs = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=32)
    compiled = _logits_per_step(LLM("tiny", compile=True, **kwargs), prompts, max_tokens)
    eager = _logits_per_step(LLM("tiny", **kwargs), prompts, max_tokens)
    assert len(compiled) == len(eager) >= 3
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_deepseek_with_moe_equals_eager() -> None:
    """tiny-mla (MLA attention, routed experts) through torch.compile, split at the MLA ops. On the
    CPU in float32 the grouped expert matmul runs eagerly but cannot be traced (its shape function
    takes bf16 only), so the traced model takes FusedMoE's dense way: the same logits up to rounding."""
    prompts, max_tokens = [list(range(3, 30)), [5, 6, 7, 8]], [4, 3]
    kwargs = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=16, attention_backend="TORCH_REF_MLA")
    eager_llm = LLM("tiny-mla", **kwargs)
    eager = _logits_per_step(eager_llm, prompts, max_tokens)
    llm = LLM("tiny-mla", compile=True, **kwargs)
    compiled = _logits_per_step(llm, prompts, max_tokens)
    backend = llm.runner.compiled_forward.backend
    assert backend.num_graphs == 1
    split_at = [_ops_called(item.graph)[0][0] for item in backend.items if item.is_splitting_op]
    layers = llm.model_config.num_hidden_layers
    assert split_at == ["pagedkv::unified_mla_kv_cache_update", "pagedkv::unified_mla_attention_with_output"] * layers
    assert all(_ops_called(item.graph) == [] for item in backend.items if not item.is_splitting_op)
    mla_layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    dependencies = _kv_dependency_of_every_attention(backend.graph, *split_at[:2])
    assert dependencies == {name: name for name in mla_layers}  # each attention after its own write
    assert len(compiled) == len(eager) >= 4
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-mla"])
def test_cli_compile_in_a_new_process(model: str) -> None:
    """`python -m pagedkv generate --compile` as a user runs it, in a process where no engine ran
    before: it exits cleanly and prints what the uncompiled run prints (the summary line aside)."""

    def generate(*extra: str) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "pagedkv",
            "generate",
            "--model",
            model,
            "--device",
            "cpu",
            "--prompt-token-ids",
            "3,4,5,6,7,8,9",
            "--max-tokens",
            "3",
            *extra,
        ]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if not line.startswith("#")]

    assert generate("--compile") == generate()


def test_piece_wrapper_receives_every_piece_and_is_what_runs() -> None:
    """The hook a CUDA graph wrapper plugs into: it gets each compiled piece once, and the
    callable it returns is what the split graph calls, once per piece per forward."""
    received: list[CompiledPiece] = []
    calls: list[int] = []

    def wrap(piece: CompiledPiece) -> Callable[..., Any]:
        received.append(piece)

        def run(*args: Any) -> Any:
            calls.append(piece.index)
            return piece.runnable(*args)

        return run

    runner = ModelRunner(_config(), dataclasses.replace(PRESETS["tiny"], num_hidden_layers=3))
    config = runner.config
    compiled = compile_model(runner.model, config, wrap_piece=wrap)
    ids, positions = torch.tensor([3, 4, 5, 6]), torch.arange(4)
    with torch.inference_mode(), set_forward_context(None, config):
        hidden = runner.model(ids, positions)
        torch.testing.assert_close(hidden, compiled.eager_forward(ids, positions))
        assert [(p.index, p.is_last) for p in received] == [(0, False), (1, False), (2, False), (3, True)]
        assert calls == [0, 1, 2, 3]
        runner.model(ids[:2], positions[:2])
    assert calls == [0, 1, 2, 3] * 2 and len(received) == 4


def test_splitting_at_attention_only_keeps_the_cache_write_in_the_pieces() -> None:
    runner = _runner(2, splitting_ops=[ATTENTION])
    runner.profile_run()
    items = runner.compiled_forward.backend.items
    assert [item.is_splitting_op for item in items] == [False, True, False, True, False]
    assert [op for op, _ in _ops_called(items[0].graph)] == [KV_UPDATE]
    assert not attention_compiled_piecewise(runner.config.compilation_config)


@pytest.mark.parametrize(
    ("compilation", "needle"),
    [
        (dict(splitting_ops=["pagedkv::no_such_op"]), "splitting_ops entry 'pagedkv::no_such_op' is not a registered"),
        (dict(splitting_ops=["unified_attention_with_output"]), "use 'namespace::op'"),
        (dict(piece_compiler="tvm"), "piece_compiler must be one of"),
    ],
)
def test_bad_compilation_config(compilation: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _runner(2, **compilation)


def test_compile_is_off_by_default() -> None:
    runner = ModelRunner(_config(), dataclasses.replace(PRESETS["tiny"], num_hidden_layers=2))
    assert runner.compiled_forward is None and "forward" not in vars(runner.model)


def test_structure_key_tells_apart_pieces_that_differ_only_in_wiring() -> None:
    """Two pieces with the same ops but different argument wiring (x - y vs y - x) must not share
    one compiled callable: the backend would run the first one's code for both."""
    a, b = fx.symbolic_trace(lambda x, y: x - y), fx.symbolic_trace(lambda x, y: y - x)
    args = (torch.randn(4, 3), torch.randn(4, 3))
    assert structure_key(a, args) != structure_key(b, args)
    assert structure_key(a, args) == structure_key(fx.symbolic_trace(lambda x, y: x - y), args)


def test_structure_key_tells_apart_inputs_of_other_strides() -> None:
    """Inductor specialises on strides: a piece compiled for contiguous inputs must not be reused
    for a transposed input of the same shape."""
    g = fx.symbolic_trace(lambda x: x * 2)
    contiguous, transposed = torch.randn(4, 6), torch.randn(6, 4).t()
    assert contiguous.shape == transposed.shape
    assert structure_key(g, (contiguous,)) != structure_key(g, (transposed,))


def test_piecewise_needs_the_cache_write_split_out_too() -> None:
    """Splitting at every attention op but `unified_kv_cache_update` leaves the cache write inside
    a compiled piece: a piecewise graph would freeze the capture's slot mapping, so attention is
    not "compiled piecewise" and FULL_AND_PIECEWISE lowers to FULL_DECODE_ONLY."""
    from pagedkv.compilation import attention_compiled_piecewise
    from pagedkv.compilation.wrapper import ATTENTION_OPS
    from pagedkv.config import CompilationConfig

    everything = CompilationConfig(compile=True, splitting_ops=list(ATTENTION_OPS))
    assert attention_compiled_piecewise(everything)
    for left_out in ("pagedkv::unified_kv_cache_update", "pagedkv::unified_mla_kv_cache_update"):
        ops = [op for op in everything.splitting_ops if op != left_out]
        assert not attention_compiled_piecewise(CompilationConfig(compile=True, splitting_ops=ops)), left_out
    assert not attention_compiled_piecewise(CompilationConfig(compile=False, splitting_ops=list(ATTENTION_OPS)))


def _kv_dependency_of_every_attention(graph: fx.GraphModule, update: str, attention: str) -> dict[str, str | None]:
    """Layer name -> the layer whose cache-write node feeds that layer's attention node as
    `kv_cache_dummy_dep` (None when the attention node takes no such input)."""
    writes = {node: node.args[-1] for node in graph.graph.nodes if op_name(node.target) == update}
    return {
        node.args[-1]: writes.get(node.kwargs.get("kv_cache_dummy_dep"))
        for node in graph.graph.nodes
        if op_name(node.target) == attention
    }


def test_every_traced_attention_takes_its_own_cache_write_as_input(traced) -> None:
    """The dummy tensor the cache write returns is an input of the attention op of the same layer:
    that data edge is all that keeps a graph pass (or the split) from running attention before
    the write on the Dynamo graph, where the cache itself is no node's output."""
    runner, _ = traced[2]
    graph = runner.compiled_forward.backend.graph  # the whole Dynamo graph, before the split
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    assert _kv_dependency_of_every_attention(graph, KV_UPDATE, ATTENTION) == {name: name for name in layers}
