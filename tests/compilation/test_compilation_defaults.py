"""The device defaults of `cudagraph_mode` and `compile`, and the on-disk compile cache.

On CUDA an engine runs vLLM's defaults (FULL_AND_PIECEWISE, compiled) unless told otherwise;
on the CPU, or with enforce_eager, it runs eagerly. CUDA is mocked: `create_engine_config`
only asks torch whether a device exists, it builds nothing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedkv.__main__ as cli
from pagedkv.config import CompilationConfig, CUDAGraphMode
from pagedkv.engine.arg_utils import EngineArgs

M = CUDAGraphMode


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports two CUDA devices (enough for tensor_parallel_size=2)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def compilation(device: str, **kwargs: Any) -> CompilationConfig:
    config, _ = EngineArgs("tiny", device=device, **kwargs).create_engine_config()
    return config.compilation_config


def resolved(config: CompilationConfig) -> tuple[CUDAGraphMode, bool]:
    return config.cudagraph_mode, config.compile


def test_the_cpu_default_is_eager() -> None:
    assert resolved(compilation("cpu")) == (M.NONE, False)


def test_the_cuda_default_is_full_and_piecewise_compiled(two_gpus: None) -> None:
    config = compilation("cuda")
    assert resolved(config) == (M.FULL_AND_PIECEWISE, True) and not config.enforce_eager


def test_a_device_left_to_pick_gets_the_cuda_default_where_cuda_is(two_gpus: None) -> None:
    assert resolved(compilation(None)) == (M.FULL_AND_PIECEWISE, True)


def test_enforce_eager_means_no_graphs_and_no_compile(two_gpus: None) -> None:
    assert resolved(compilation("cuda", enforce_eager=True)) == (M.NONE, False)


@pytest.mark.parametrize(
    ("device", "kwargs", "expected"),
    [
        ("cuda", dict(cudagraph_mode="FULL", compile=False), (M.FULL, False)),
        ("cuda", dict(cudagraph_mode="NONE"), (M.NONE, True)),
        ("cuda", dict(cudagraph_mode=M.PIECEWISE), (M.PIECEWISE, True)),
        # Without the compile the default keeps only what needs none: full decode graphs.
        ("cuda", dict(compile=False), (M.FULL_DECODE_ONLY, False)),
        # enforce_eager lowers an explicit mode at start-up (with a warning), and an explicit compile stays.
        ("cuda", dict(enforce_eager=True, compile=True, cudagraph_mode="FULL"), (M.FULL, True)),
        ("cpu", dict(cudagraph_mode="FULL_AND_PIECEWISE", compile=True), (M.FULL_AND_PIECEWISE, True)),
        ("cpu", dict(compile=True), (M.NONE, True)),
    ],
    ids=[
        "cuda-full-uncompiled",
        "cuda-none",
        "cuda-piecewise",
        "cuda-uncompiled",
        "cuda-eager-explicit",
        "cpu-explicit",
        "cpu-compiled",
    ],
)
def test_explicit_values_are_kept(
    two_gpus: None, device: str, kwargs: dict[str, Any], expected: tuple[CUDAGraphMode, bool]
) -> None:
    assert resolved(compilation(device, **kwargs)) == expected


def test_the_tensor_parallel_default_is_what_tensor_parallelism_supports(two_gpus: None) -> None:
    """Ranks capture whole-model graphs only: the default leaves the compile and the piecewise part out."""
    assert resolved(compilation("cuda", tensor_parallel_size=2)) == (M.FULL_DECODE_ONLY, False)
    assert resolved(compilation("cuda", tensor_parallel_size=2, cudagraph_mode="FULL")) == (M.FULL, False)
    with pytest.raises(NotImplementedError, match=r"got cudagraph_mode=FULL_AND_PIECEWISE, compile=True"):
        compilation("cuda", tensor_parallel_size=2, cudagraph_mode="FULL_AND_PIECEWISE", compile=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        (dict(compile="yes"), TypeError, "compile must be True or False, got 'yes'"),
        (dict(enforce_eager=None), TypeError, "enforce_eager must be True or False, got None"),
    ],
)
def test_bad_values_are_still_refused(kwargs: dict[str, Any], error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        compilation("cpu", **kwargs)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], dict(cudagraph_mode=None, compile=None, enforce_eager=False)),
        (["--enforce-eager"], dict(cudagraph_mode=None, compile=None, enforce_eager=True)),
        (["--compile", "--cudagraph-mode", "FULL"], dict(cudagraph_mode="FULL", compile=True, enforce_eager=False)),
        (["--no-compile"], dict(cudagraph_mode=None, compile=False, enforce_eager=False)),
    ],
)
def test_the_cli_leaves_the_defaults_to_llm(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], expected: dict[str, Any]
) -> None:
    got: dict[str, Any] = {}

    def fake_llm(model: str, **kwargs: Any) -> None:
        got.update(kwargs)
        raise SystemExit(0)  # main() catches Exception, not SystemExit: nothing is built

    monkeypatch.setattr(cli, "LLM", fake_llm)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", *flags])
    assert {key: got[key] for key in expected} == expected


# ---- the compile cache ----------------------------------------------------------------------------

COMPILE_ONCE = textwrap.dedent("""
    import dataclasses, logging, sys
    from pagedkv.config import CompilationConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pagedkv.models.loader import PRESETS
    from pagedkv.worker.model_runner import ModelRunner

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    config = EngineConfig(ModelConfig(model="tiny"), scheduler_config=SchedulerConfig(max_num_batched_tokens=8),
                          compilation_config=CompilationConfig(compile=True, piece_compiler="inductor"))
    runner = ModelRunner(config, dataclasses.replace(PRESETS["tiny"], num_hidden_layers=1))
    runner.profile_run()  # traces and compiles
    print("STATE", runner.compiled_forward.cache.state)
""")


@pytest.mark.slow
def test_a_second_process_finds_the_compile_cache_warm(tmp_path: Path) -> None:
    """Inductor on the CPU (C++ pieces), one layer: the first process compiles and writes the cache
    under $PAGEDKV_CACHE_DIR, the second loads every piece from it (about 25 s on two cores)."""
    env = {"PAGEDKV_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def compile_once() -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_ONCE], capture_output=True, text=True, timeout=600, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.splitlines()

    cold, warm = compile_once(), compile_once()
    assert "STATE cold" in cold and "STATE warm" in warm
    assert any(
        line.startswith("torch.compile: traced and compiled in") and "compile cache warm" in line for line in warm
    )
    assert any((tmp_path / "inductor").iterdir())
