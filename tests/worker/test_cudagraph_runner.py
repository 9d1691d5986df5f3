"""CUDA graphs in the runner, on the CPU (`pagedkv.worker.cudagraph`, issue 9 points 2 and 6).

Host-side logic is checked directly: capture sizes, padding, the dispatcher's choice for every
resolved mode (against a table written out by hand), the start-up resolution and its log, the
LLM / CLI arguments and the trace fields.

The graph machinery itself (persistent inputs, padding, capture metadata, the FULL wrapper
around the model and the PIECEWISE wrappers around compiled pieces) is run end to end with
`EmulatedGraph` standing in for `torch.cuda.CUDAGraph`: a replay re-runs the captured call
*in the forward context of the capture*, which is what a real graph has baked in (every
metadata object and tensor it saw then). So a step whose inputs or metadata did not reach the
tensors the capture used computes the capture's dummy batch and fails the comparison with
eager logits, as it would on a GPU. tests/gpu/test_cudagraph_cuda.py replays real graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

import pagedkv.forward_context as forward_context
import pagedkv.worker.model_runner as model_runner
from pagedkv import LLM, SamplingParams
from pagedkv.__main__ import main as cli
from pagedkv.attention.backend import AttentionCGSupport as S
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.backends.triton_attn import TritonAttentionBackend
from pagedkv.config import (
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedkv.config import CUDAGraphMode as M
from pagedkv.forward_context import BatchDescriptor as D
from pagedkv.forward_context import set_forward_context
from pagedkv.trace import StepTrace
from pagedkv.worker import cudagraph
from pagedkv.worker.attn_utils import (
    min_cudagraph_support,
    to_kernel_block_table,
)
from tests.conftest import needs_triton_on_cpu


class EmulatedGraph:
    """A CUDA graph's semantics on the CPU: replays reuse the capture's arguments and forward
    context, and write the new results into the tensors the capture returned."""

    def __init__(self, memory: cudagraph.GraphMemory) -> None:
        self.output: Any = None

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        self.fn, self.args, self.context = fn, tuple(args), forward_context._forward_context
        self.output = fn(*args)
        return self.output

    def replay(self) -> Any:
        saved, forward_context._forward_context = forward_context._forward_context, self.context
        try:
            new = self.fn(*self.args)
        finally:
            forward_context._forward_context = saved
        for old, value in zip(tree_flatten(self.output)[0], tree_flatten(new)[0]):
            if isinstance(old, torch.Tensor):
                old.copy_(value)
        return self.output


@pytest.fixture
def emulated_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudagraph, "TorchCUDAGraph", EmulatedGraph)
    monkeypatch.setattr(cudagraph, "cuda_graphs_unavailable_reason", lambda device: None)


# ---- capture sizes and padding ---------------------------------------------------------------


def _config(max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, **compilation: Any) -> EngineConfig:
    return EngineConfig(
        ModelConfig("tiny"),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        compilation_config=CompilationConfig(**compilation),
    )


def test_capture_sizes() -> None:
    assert cudagraph.default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cudagraph.default_capture_sizes(7) == [1, 2, 4]
    assert cudagraph.default_capture_sizes(2) == [1, 2]
    assert cudagraph.capture_sizes(_config()) == [1, 2, 4] + list(range(8, 129, 8))  # 2 x 64 seqs
    assert cudagraph.capture_sizes(_config(max_num_seqs=1000))[-1] == 512
    assert cudagraph.capture_sizes(_config(max_num_batched_tokens=20)) == [1, 2, 4, 8, 16]
    assert cudagraph.capture_sizes(_config(max_cudagraph_capture_size=24)) == [1, 2, 4, 8, 16, 24]
    assert cudagraph.capture_sizes(_config(cudagraph_capture_sizes=[8, 3, 8])) == [3, 8]
    for bad in ([0, 4], [4096], [2.0], 16):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a list of ints in"):
            cudagraph.capture_sizes(_config(cudagraph_capture_sizes=bad))


def test_padding_goes_to_the_next_capture_size() -> None:
    dispatcher = cudagraph.CudagraphDispatcher(M.PIECEWISE, [1, 2, 4, 8, 16, 24], max_num_seqs=8)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 24: 24, 25: None, 100: None}
    assert {n: dispatcher.padded_num_tokens(n) for n in expected} == expected


def test_capture_batches() -> None:
    assert cudagraph.capture_query_lens(D(4, uniform_decode=True), max_num_seqs=8) == [1, 1, 1, 1]
    assert cudagraph.capture_query_lens(D(16), max_num_seqs=8) == [2] * 8  # as many requests as allowed
    assert cudagraph.capture_query_lens(D(24), max_num_seqs=5) == [5, 5, 5, 5, 4]
    assert cudagraph.capture_query_lens(D(2), max_num_seqs=8) == [1, 1]
    assert cudagraph.capture_num_reqs(D(16), max_num_seqs=8) == 8
    assert cudagraph.capture_num_reqs(D(4, uniform_decode=True), max_num_seqs=8) == 4


def test_speculative_decode_keys_are_multiples_of_one_plus_k() -> None:
    """k = 2: uniform decode batches get keys of 3 x (1, 2, 4, 8) tokens, so a batch of whole requests
    is padded with whole requests; under FULL too (a mixed key's bounds must allow one long request)."""
    config = _config(max_num_seqs=8)
    config.speculative_config = SpeculativeConfig("ngram", 2)
    assert cudagraph.capture_sizes(config)[-1] == 48  # 2 x 8 requests x 3 tokens
    for mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE, M.FULL):
        dispatcher = cudagraph.CudagraphDispatcher(mode, [1, 2, 4, 8, 16, 24], 8, 3, 2048)
        assert dispatcher.decode_sizes == [3, 6, 12, 24]
        # 3 requests x 3 tokens -> the 4-request key; 5 x 3 -> 8 x 3.
        assert dispatcher.dispatch(9, uniform_decode=True) == (M.FULL, D(12, uniform_decode=True))
        assert dispatcher.dispatch(15, uniform_decode=True) == (M.FULL, D(24, uniform_decode=True))
    assert cudagraph.capture_query_lens(D(12, uniform_decode=True), 8, uniform_decode_query_len=3) == [3] * 4
    assert cudagraph.capture_num_reqs(D(24, uniform_decode=True), 8, uniform_decode_query_len=3) == 8
    assert cudagraph.capture_num_reqs(D(24), 8, uniform_decode_query_len=3) == 8  # a mixed key: any lengths


SIZES = [1, 2, 4, 8, 16]  # max_num_seqs 8: decode graphs up to 8 requests
# resolved mode -> {(num_tokens, uniform_decode): (runtime mode, key)}, worked out by hand.
DISPATCH = {
    M.NONE: {(3, True): (M.NONE, D(3, True)), (5, False): (M.NONE, D(5))},
    M.PIECEWISE: {
        (3, True): (M.PIECEWISE, D(4)),
        (5, False): (M.PIECEWISE, D(8)),
        (16, False): (M.PIECEWISE, D(16)),
        (17, False): (M.NONE, D(17)),
    },
    M.FULL: {
        (3, True): (M.FULL, D(4)),
        (5, False): (M.FULL, D(8)),
        (12, True): (M.FULL, D(16)),
        (17, True): (M.NONE, D(17, True)),
    },
    M.FULL_DECODE_ONLY: {
        (3, True): (M.FULL, D(4, True)),
        (8, True): (M.FULL, D(8, True)),
        (12, True): (M.NONE, D(12, True)),
        (5, False): (M.NONE, D(5)),
    },
    M.FULL_AND_PIECEWISE: {
        (1, True): (M.FULL, D(1, True)),
        (3, True): (M.FULL, D(4, True)),
        (12, True): (M.PIECEWISE, D(16)),
        (5, False): (M.PIECEWISE, D(8)),
        (17, False): (M.NONE, D(17)),
    },
}


@pytest.mark.parametrize("mode", list(DISPATCH), ids=lambda m: m.name)
def test_dispatcher_picks_full_then_piecewise_then_none(mode: M) -> None:
    dispatcher = cudagraph.CudagraphDispatcher(mode, SIZES, max_num_seqs=8)
    got = {batch: dispatcher.dispatch(*batch) for batch in DISPATCH[mode]}
    assert got == DISPATCH[mode]
    captures = dispatcher.captures()
    sizes = [key.num_tokens for _, key in captures]
    assert sizes == sorted(sizes, reverse=True), "largest first"
    decode_graphs = [key for runtime, key in captures if key.uniform_decode]
    mixed_graphs = [(runtime, key.num_tokens) for runtime, key in captures if not key.uniform_decode]
    separate = mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)
    assert [key.num_tokens for key in decode_graphs] == ([8, 4, 2, 1] if separate else [])
    mixed = mode.mixed_mode()
    assert mixed_graphs == ([] if mixed is M.NONE else [(mixed, s) for s in reversed(SIZES)])


# ---- the graph wrapper ------------------------------------------------------------------------


class RecordingGraph:
    """A graph that only counts: capture runs the call once, replay returns the output."""

    def __init__(self, memory: cudagraph.GraphMemory) -> None:
        self.replays = 0

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        self.output = fn(*args)
        return self.output

    def replay(self) -> Any:
        self.replays += 1
        return self.output


def test_wrapper_obeys_the_forward_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudagraph, "TorchCUDAGraph", RecordingGraph)
    calls: list[int] = []
    wrapper = cudagraph.CUDAGraphWrapper(lambda x: calls.append(x) or x * 2, M.PIECEWISE, cudagraph.GraphMemory(), "p")
    config = _config()

    def call(mode: M, key: D | None, x: int) -> int:
        with set_forward_context(None, config, cudagraph_runtime_mode=mode, batch_descriptor=key):
            return wrapper(x)

    assert call(M.NONE, D(4), 1) == 2 and call(M.FULL, D(4), 2) == 4  # not its mode: a plain call
    with pytest.raises(RuntimeError, match="graphs are captured at start-up only"):
        call(M.PIECEWISE, D(4), 3)
    with cudagraph.capture_phase():
        assert call(M.PIECEWISE, D(4), 5) == 10  # captured
    assert call(M.PIECEWISE, D(4), 6) == 10  # replayed: the capture's result, no call
    assert calls == [1, 2, 5] and wrapper.graphs[D(4)].replays == 1
    assert wrapper.replay(D(4)) == 10  # without any forward context
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        cudagraph.CUDAGraphWrapper(lambda: None, M.FULL_AND_PIECEWISE, cudagraph.GraphMemory(), "x")


def test_weakest_support_names_its_backend() -> None:
    def group(backend: type, support: S) -> SimpleNamespace:
        return SimpleNamespace(backend=backend, metadata_builder=SimpleNamespace(cudagraph_support=support))

    groups = [[group(TritonAttentionBackend, S.ALWAYS)], [group(TorchRefBackend, S.NEVER)]]
    assert min_cudagraph_support(groups) == (S.NEVER, "TORCH_REF")
    assert min_cudagraph_support(groups[:1]) == (S.ALWAYS, "TRITON_ATTN")
    assert min_cudagraph_support([]) == (S.ALWAYS, "no attention")


def test_kernel_block_table_into_a_persistent_buffer() -> None:
    table = torch.tensor([[7, 2, 0], [1, 0, 0]], dtype=torch.int32)
    out = torch.full((4, 6), -1, dtype=torch.int32)
    view = to_kernel_block_table(table, 2, out)
    assert view.data_ptr() == out.data_ptr() and view.tolist() == [[14, 15, 4, 5, 0, 1], [2, 3, 0, 1, 0, 1]]
    assert torch.equal(view, to_kernel_block_table(table, 2)) and out[2:].eq(-1).all()


# ---- the engine on the CPU --------------------------------------------------------------------

PROMPTS = [list(range(1, 12)), [5, 6, 7], [9, 8]]
MAX_TOKENS = [5, 3, 4]
ENGINE = dict(device="cpu", attention_backend="TRITON_ATTN", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)


Step = tuple[str, D, int, torch.Tensor]


def _run(llm: LLM) -> list[Step]:
    """Per step: runtime mode, batch descriptor, calls of set_forward_context, logits."""
    calls: list[int] = []
    real = model_runner.set_forward_context

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    steps = []

    def listen(event: Any) -> None:
        result = event.result
        steps.append((result.cudagraph_mode.name, result.batch_descriptor, len(calls), result.logits.clone()))
        calls.clear()

    detach = llm.add_step_listener(listen)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(model_runner, "set_forward_context", counting)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    detach()
    return steps


def _assert_same_logits(steps: list[Step], reference: list[Step], tolerance: float) -> None:
    assert len(steps) == len(reference)
    for (_, _, _, got), (_, _, _, want) in zip(steps, reference):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def eager_steps() -> list[Step]:
    return _run(LLM("tiny", **ENGINE))


# (mode, compile) -> per step: (runtime mode, padded tokens) for the schedule of PROMPTS:
# 8 prefill tokens, 3 + 3 + 2 prefill tokens, then decodes of 3, 3, 2 and 1 request(s).
GRAPH_STEPS = {
    (M.FULL_AND_PIECEWISE, True): [
        ("PIECEWISE", 8),
        ("PIECEWISE", 8),
        ("FULL", 4),
        ("FULL", 4),
        ("FULL", 2),
        ("FULL", 1),
    ],
    (M.FULL_DECODE_ONLY, False): [("NONE", 8), ("NONE", 8), ("FULL", 4), ("FULL", 4), ("FULL", 2), ("FULL", 1)],
    (M.FULL, False): [("FULL", 8), ("FULL", 8), ("FULL", 4), ("FULL", 4), ("FULL", 2), ("FULL", 1)],
}


@pytest.mark.slow
@needs_triton_on_cpu("TRITON_ATTN")
@pytest.mark.parametrize(("mode", "compile"), list(GRAPH_STEPS), ids=lambda v: getattr(v, "name", str(v)))
def test_graph_steps_give_eager_logits(mode: M, compile: bool, eager_steps: list[Step], emulated_graphs: None) -> None:
    """Decodes replay FULL graphs without a forward context; mixed steps run piecewise (compiled)
    or eagerly; every step's logits equal the eager engine's."""
    llm = LLM("tiny", cudagraph_mode=mode, compile=compile, **ENGINE)
    assert llm.runner.cudagraph_mode is mode
    with StepTrace.attach(llm) as trace:
        steps = _run(llm)
    assert [(m, d.num_tokens) for m, d, _, _ in steps] == GRAPH_STEPS[(mode, compile)]
    assert [calls for m, _, calls, _ in steps] == [0 if m == "FULL" else 1 for m, *_ in steps]
    _assert_same_logits(steps, eager_steps, 1e-4)
    # The trace: the step's own 3 tokens, the padded key, the runtime mode.
    decode = trace[2]
    assert (decode.cudagraph_mode, decode.batch_descriptor["num_tokens"], decode.num_tokens) == ("FULL", 4, 3)
    assert decode.batch_descriptor["uniform_decode"] is (mode is not M.FULL) and -1 not in decode.slot_mappings[0]
    assert trace.engine.cudagraph_mode == mode.name and trace.engine.cudagraph_capture_sizes == [1, 2, 4, 8]


def test_piecewise_with_a_backend_that_cannot_capture(emulated_graphs: None, caplog: pytest.LogCaptureFixture) -> None:
    """TORCH_REF loops over host-side lengths (support NEVER): FULL_AND_PIECEWISE lowers to
    PIECEWISE, attention runs eagerly between the pieces' graphs, logits stay eager ones."""
    engine = {**ENGINE, "attention_backend": "TORCH_REF"}
    caplog.set_level(logging.INFO, logger="pagedkv")
    eager = _run(LLM("tiny", **engine))
    llm = LLM("tiny", cudagraph_mode="full_and_piecewise", compile=True, **engine)
    steps = _run(llm)
    assert llm.runner.cudagraph_mode is M.PIECEWISE
    assert (
        "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with TORCH_REF backend (support: NEVER); "
        "setting cudagraph_mode=PIECEWISE" in caplog.text
    )
    assert [(m, d.num_tokens, calls) for m, d, calls, _ in steps] == [
        ("PIECEWISE", 8, 1),
        ("PIECEWISE", 8, 1),
        ("PIECEWISE", 4, 1),
        ("PIECEWISE", 4, 1),
        ("PIECEWISE", 2, 1),
        ("PIECEWISE", 1, 1),
    ]
    _assert_same_logits(steps, eager, 1e-5)


def test_cpu_engines_run_eagerly_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagedkv")
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, cudagraph_mode="FULL_AND_PIECEWISE")
    assert llm.runner.cudagraph_mode is M.NONE and llm.runner.dispatcher is None
    assert (
        "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with a cpu device; setting cudagraph_mode=NONE "
        "(every step runs eagerly: CUDA graphs need a CUDA device; this engine runs on cpu)" in caplog.text
    )
    caplog.clear()
    LLM("tiny", device="cpu", num_kv_blocks=16)
    assert "cudagraph_mode NONE: every step runs eagerly (CUDA graphs need a CUDA device" in caplog.text


@needs_triton_on_cpu("TRITON_ATTN")
def test_enforce_eager_wins(caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM("tiny", cudagraph_mode="FULL_DECODE_ONLY", enforce_eager=True, **ENGINE)
    assert llm.runner.cudagraph_mode is M.NONE and llm.runner.full_graph is None
    expected = "CUDAGraphMode.FULL_DECODE_ONLY is not supported with enforce_eager=True; setting cudagraph_mode=NONE"
    assert expected in caplog.text


def test_compile_flag_on_the_cpu_gives_eager_logits() -> None:
    engine = dict(device="cpu", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)
    eager = _run(LLM("tiny", **engine))
    llm = LLM("tiny", compile=True, **engine)
    compiled = _run(llm)
    assert llm.runner.compiled_forward is not None and llm.runner.compiled_forward.backend.num_graphs == 1
    assert [m for m, *_ in compiled] == ["NONE"] * len(eager)
    _assert_same_logits(compiled, eager, 1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        (dict(cudagraph_mode=3), TypeError, "cudagraph_mode must be a CUDAGraphMode or one of its names"),
        (dict(cudagraph_mode="sometimes"), ValueError, "Unknown cudagraph_mode 'sometimes'"),
        (dict(enforce_eager="yes"), TypeError, "enforce_eager must be True or False"),
        (dict(compile=1), TypeError, "compile must be True or False"),
        (dict(max_cudagraph_capture_size=0), ValueError, "max_cudagraph_capture_size must be an int >= 1"),
    ],
)
def test_bad_cudagraph_arguments(kwargs: dict[str, Any], error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        LLM("tiny", device="cpu", num_kv_blocks=16, **kwargs)


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--device", "cpu", "--num-kv-blocks", "16", "--max-tokens", "2", "--prompt", "hi"]
    cli([*base, "--cudagraph-mode", "full_decode_only", "--compile"])
    assert "cudagraph_mode NONE" in capsys.readouterr().err  # the CPU has no CUDA graphs
    cli([*base, "--enforce-eager"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli([*base, "--cudagraph-mode", "sometimes"])
    assert exit_info.value.code == 2 and "Unknown cudagraph_mode 'sometimes'" in capsys.readouterr().err


def test_traces_without_graph_fields_still_load() -> None:
    trace = StepTrace.load(Path(__file__).resolve().parents[2] / "notebooks" / "traces" / "h200_tiny-hybrid.json")
    assert trace.engine.cudagraph_mode == "NONE" and trace.engine.cudagraph_capture_sizes == []
    assert {record.cudagraph_mode for record in trace} == {"NONE"}


def test_decode_graphs_cover_max_num_seqs_requests_of_several_tokens() -> None:
    """Decode steps of 2 query tokens, at most 4 requests: decode FULL graphs for 2..8 tokens
    (4 requests x 2 tokens), worked by hand; 8 tokens of uniform decode replays FULL."""
    dispatcher = cudagraph.CudagraphDispatcher(
        M.FULL_DECODE_ONLY, [1, 2, 4, 8, 16], max_num_seqs=4, uniform_decode_query_len=2
    )
    decode = sorted(k.num_tokens for mode, k in dispatcher.captures() if k.uniform_decode)
    assert decode == [2, 4, 8]
    assert dispatcher.dispatch(7, True) == (M.FULL, D(8, True))
    assert dispatcher.dispatch(16, True) == (M.NONE, D(16, True))
