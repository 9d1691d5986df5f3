"""Tensor-parallel engines beside each other and under faults: other engines, Ctrl-C, a stopped
worker, an attention backend only the driver has, notebook 10 run twice.

Each test is bounded by `time_bound`: a hang (the old failure mode: a collective waiting 120 s
for a rank that will never join) kills the workers, which unblocks the driver, and fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import register_backend, unregister_backend
from pagedkv.worker.tp_executor import EngineDeadError
from tests.distributed.test_tensor_parallel import assert_no_workers_left

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 3, 44]}, {"prompt_token_ids": [60, 12, 8]}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=32, block_size=4)


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: after `seconds`, kill every worker process (the driver's blocked
    collective then fails at once) and fail the test."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        for child in multiprocessing.active_children():
            child.kill()

    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        yield
    except BaseException as error:
        if expired.is_set():
            raise AssertionError(f"did not finish within {seconds} s") from error
        raise
    finally:
        timer.cancel()
    assert not expired.is_set(), f"did not finish within {seconds} s"


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return tokens(LLM("tiny", **ENGINE))


@pytest.mark.slow
def test_engines_side_by_side(reference: list[list[int]]) -> None:
    """tp=1 and two tp=2 engines in one process, interleaved; a tp=1 engine built while a tp=2 one
    lives is whole; a tp=2 start-up that fails leaves the others working."""
    with time_bound(60):
        one = LLM("tiny", **ENGINE)
        two = LLM("tiny", tensor_parallel_size=2, **ENGINE)
        assert tokens(one) == reference  # used to all-reduce in the tp=2 engine's group and hang
        whole = LLM("tiny", **ENGINE)
        layer = whole.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.shape == one.runner.model.model.layers[0].self_attn.qkv_proj.weight.shape
        with pytest.raises(ValueError, match="NOT_A_BACKEND"):  # used to end `two`'s group on its way out
            LLM("tiny", tensor_parallel_size=2, attention_backend="NOT_A_BACKEND", **ENGINE)
        with LLM("tiny", tensor_parallel_size=2, **ENGINE) as three:
            for llm in (two, whole, three, one, two, three):
                assert tokens(llm) == reference
        two.shutdown()
    assert_no_workers_left()


def test_ctrl_c_during_a_step_leaves_the_engine_able_to_go_on(reference: list[list[int]]) -> None:
    """Ctrl-C in a terminal: SIGINT to the driver, here in the middle of a step (after the step's
    broadcast, before its all-reduces), and to the worker. The driver raises KeyboardInterrupt
    once the step is done on every rank; the worker lives on; the next run is the same."""
    with time_bound(60), LLM("tiny", tensor_parallel_size=2, **ENGINE) as llm:
        runner, run = llm.runner, llm.runner.execute_model

        def interrupted(*args: object) -> object:
            runner.execute_model = run  # once
            os.kill(llm._executor.workers[0].pid, signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return run(*args)

        runner.execute_model = interrupted
        with pytest.raises(KeyboardInterrupt):
            tokens(llm)
        start = time.monotonic()
        assert tokens(llm) == reference
        assert time.monotonic() - start < 10
        assert llm._executor.workers[0].is_alive()
    assert_no_workers_left()


@pytest.mark.slow
def test_stopped_worker_is_named_and_an_idle_one_is_not(
    monkeypatch: pytest.MonkeyPatch, reference: list[list[int]]
) -> None:
    """A step's collectives time out (4 s here, 20 s by default); the heartbeats say which rank
    stopped. A worker waiting longer than that for the next step is merely idle."""
    monkeypatch.setenv("PAGEDKV_TP_STEP_TIMEOUT_S", "4")
    with time_bound(45):
        llm = LLM("tiny", tensor_parallel_size=2, **ENGINE)
        tokens(llm)
        time.sleep(5)
        assert tokens(llm) == reference
        os.kill(llm._executor.workers[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) stopped answering") as error:
            tokens(llm)
        assert time.monotonic() - start < 10
        told = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
        assert "can serve other requests" not in told and "cannot continue" in told  # one story
        with pytest.raises(EngineDeadError, match="cannot continue"):
            tokens(llm)
    assert_no_workers_left()


def test_bad_step_timeout_is_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_TP_STEP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"PAGEDKV_TP_STEP_TIMEOUT_S must be a number of seconds > 0, got 'soon'"):
        LLM("tiny", tensor_parallel_size=2, **ENGINE)
    assert multiprocessing.active_children() == []


class RenamedTorchRef(TorchRefBackend):
    """A user backend in an importable module: the workers register it too. A worker takes a
    second longer than the driver to build its layers with it: the driver waits for it."""

    @staticmethod
    def get_name() -> str:
        return "TEST_RENAMED_TORCH_REF"

    @classmethod
    def validate_configuration(cls, **layer: object) -> list[str]:
        if multiprocessing.parent_process() is not None and not getattr(cls, "slowed", False):
            cls.slowed = True
            time.sleep(1)
        return super().validate_configuration(**layer)


@pytest.mark.slow
def test_user_backend_reaches_the_workers_or_is_refused_at_once(reference: list[list[int]]) -> None:
    driver_only = type(
        "NotebookBackend",
        (RenamedTorchRef,),
        {"__module__": "__main__", "get_name": staticmethod(lambda: "TEST_NOTEBOOK_BACKEND")},
    )
    register_backend(RenamedTorchRef)
    register_backend(driver_only)
    try:
        with time_bound(60):
            with LLM("tiny", tensor_parallel_size=2, attention_backend="TEST_RENAMED_TORCH_REF", **ENGINE) as llm:
                assert tokens(llm) == reference
            with pytest.raises(
                ValueError,
                match=r"^Attention backend 'TEST_NOTEBOOK_BACKEND' \(__main__\."
                r"NotebookBackend\) is registered only in this process: [^\n]*"
                r"Define the class in a module they can import[^\n]*$",
            ):
                LLM("tiny", tensor_parallel_size=2, attention_backend="TEST_NOTEBOOK_BACKEND", **ENGINE)
            assert multiprocessing.active_children() == []  # refused before any worker started
    finally:
        unregister_backend("TEST_RENAMED_TORCH_REF")
        unregister_backend("TEST_NOTEBOOK_BACKEND")
    assert_no_workers_left()


@pytest.mark.slow
def test_notebook_10_engine_cells_run_twice() -> None:
    """The cell that builds a tp=1 and a tp=2 engine, run again while both still live (it used to
    hang), then the cell that prints rank 0's layers: their saved outputs each time."""
    path = Path(__file__).resolve().parents[2] / "notebooks" / "10_tensor_parallelism.ipynb"
    nb = nbformat.read(path, as_version=4)

    def cell(text: str) -> int:
        return next(i for i, c in enumerate(nb.cells) if text in c.source)

    def printed(index: int) -> str:
        return "".join(out.get("text", "") for out in nb.cells[index].outputs)

    build, layers = cell("two, two_texts, two_logits = serve(2)"), cell('print("qkv_proj:"')
    shut_down = cell("two.shutdown()")
    saved = {i: printed(i) for i in (build, layers)}
    client = NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        client.execute_cell(nb.cells[1], 1)
        for index in (build, build, layers):
            client.execute_cell(nb.cells[index], index)
            assert printed(index) == saved[index], f"cell {index}"
        client.execute_cell(nb.cells[shut_down], shut_down)
