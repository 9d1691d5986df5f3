"""What the whole-engine benchmarks share: the device, engine modes, timed `generate`, the run's metadata.

A *mode* names how a benchmark row builds its engine (`mode_kwargs`):

    default               only the model, the KV cache size and the batch limits: the engine's own defaults
    eager                 enforce_eager=True (no CUDA graph)
    PIECEWISE, FULL,      cudagraph_mode=<name>, with torch.compile where the mode has piecewise
    FULL_DECODE_ONLY,     graphs (PIECEWISE, FULL_AND_PIECEWISE), without it otherwise
    FULL_AND_PIECEWISE
    <mode>+async, +sync   the same with async_scheduling on / off (else the engine's default)
    <mode>+invariant      the same with batch_invariant=True (bitwise-identical logits in any batch)
    <mode>+fp8            the same with an fp8 (e4m3) KV cache: twice the blocks in the same memory

Used by end_to_end.py, prefix_caching.py, speculative.py, tensor_parallel.py and sampler_cpu.py.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: lets an older checkout be timed

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.config import CUDAGraphMode  # noqa: E402
from pagedkv.engine.request import RequestOutput  # noqa: E402

DEVICE = "cuda"
"""Where engines run; `--device cpu` smoke-tests a benchmark on the tiny preset (set by each script's main)."""

GRAPH_MODES = ("PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
ALL_MODES = ("default", "eager", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE+async", "FULL_AND_PIECEWISE+sync")
"""The rows of `--modes all`: defaults, eager, FULL graphs for decodes only, FULL + compiled
piecewise graphs with async scheduling on and off."""


def mode_kwargs(mode: str) -> dict[str, object]:
    """`LLM` keyword arguments of a mode (see the module docstring); a ValueError names the valid ones."""
    name, *suffixes = mode.split("+")
    if name not in ("default", "eager", *GRAPH_MODES) or any(
        x not in ("async", "sync", "invariant", "fp8") for x in suffixes
    ):
        raise ValueError(
            f"unknown mode {mode!r}: one of default, eager, {', '.join(GRAPH_MODES)}, "
            "optionally followed by +async or +sync, +invariant and +fp8 (an fp8 KV cache)"
        )
    kwargs: dict[str, object] = {}
    if name == "eager":
        kwargs["enforce_eager"] = True
    elif name != "default":
        piecewise = CUDAGraphMode[name].requires_piecewise_compilation()
        kwargs.update(cudagraph_mode=name, compile=piecewise, enforce_eager=False)
    for suffix in suffixes:
        if suffix == "invariant":
            kwargs["batch_invariant"] = True
        elif suffix == "fp8":
            kwargs["kv_cache_dtype"] = "fp8"
        else:
            kwargs["async_scheduling"] = suffix == "async"
    return kwargs


def engine_kwargs(mode: str, backend: str | None, engine: dict[str, object]) -> dict[str, object]:
    """Everything `LLM(model, ...)` gets for a row: the workload's limits, the mode, the device.

    On the CPU the device and float32 are given (the smoke test); on CUDA the engine's defaults
    pick them (bf16), so the "default" row passes nothing but the workload's limits.
    """
    kwargs = {**engine, **mode_kwargs(mode)}
    if backend:
        kwargs["attention_backend"] = backend
    if DEVICE != "cuda":
        kwargs.update(device=DEVICE, dtype="float32")
    return kwargs


def describe(llm: LLM) -> dict[str, object]:
    """What the engine resolved its arguments to (the mode it captured, compile, scheduling, backends)."""
    compilation = llm.config.compilation_config
    mode = getattr(llm.runner, "cudagraph_mode", compilation.cudagraph_mode)
    backends = sorted({layer.attn_backend.get_name() for layer in llm.runner.attn_layers.values()})
    return {
        "cudagraph_mode": getattr(mode, "name", str(mode)),
        "compile": compilation.compile,
        "enforce_eager": compilation.enforce_eager,
        "async_scheduling": llm.async_scheduling,
        "prefix_caching": llm.prefix_caching,
        "attention_backends": backends,
        "dtype": str(llm.config.model_config.dtype).removeprefix("torch."),
        "batch_invariant": llm.config.model_config.batch_invariant,
    }


def resolved_label(resolved: dict[str, object]) -> str:
    """A short form of `describe`'s record for tables: "FULL_AND_PIECEWISE, compiled, async"."""
    parts = [str(resolved["cudagraph_mode"])]
    if resolved.get("compile"):
        parts.append("compiled")
    parts.append("async" if resolved.get("async_scheduling") else "sync")
    if not resolved.get("prefix_caching", True):
        parts.append("prefix caching off")
    if resolved.get("batch_invariant"):
        parts.append("batch-invariant")
    return ", ".join(parts)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Give back the memory of engines nothing refers to any more (callers drop theirs first)."""
    gc.collect()  # the model and its layers reference each other through the forward-context dict
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    """The traceback on stderr; one line for the table."""
    traceback.print_exc()
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def generate_s(
    llm: LLM, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
) -> tuple[float, list[RequestOutput]]:
    """Wall seconds of one `llm.generate` over token-id prompts (GPU work included), and its outputs."""
    sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # type: ignore[arg-type]
    sync()
    return time.perf_counter() - start, outs


def timed_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
    """Queue every prompt, step until done; seconds, TTFT per request, steps with prefill tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cached_before, prefill_before = llm.stats.num_cached_tokens, llm.stats.num_prefill_tokens
    sync()
    start = time.perf_counter()
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts]
    first_token: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    prefill_steps = 0
    while llm.has_unfinished_requests():
        before = llm.stats.num_prefill_tokens
        outputs = llm.step()
        prefill_steps += llm.stats.num_prefill_tokens > before
        now = time.perf_counter()
        for out in outputs:
            first_token.setdefault(out.request_id, now - start)
            tokens[out.request_id] = out.outputs[0].token_ids
    sync()
    seconds = time.perf_counter() - start
    ttft = sorted(first_token[i] for i in ids)
    return {
        "seconds": seconds,
        "output_tokens_per_s": sum(len(tokens[i]) for i in ids) / seconds,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_max_s": ttft[-1],
        "prefill_steps": prefill_steps,
        "prefill_tokens_computed": llm.stats.num_prefill_tokens - prefill_before,
        "cached_tokens": llm.stats.num_cached_tokens - cached_before,
        "first_tokens": tokens[ids[0]][:8],
        "tokens": [tokens[i] for i in ids],  # for the caller to compare across engines
    }


def _git(*args: str) -> str:
    """`git ARGS` in this checkout: its stripped stdout."""
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10)
    return done.stdout.strip()


def run_metadata() -> dict[str, object]:
    """Date, command line, versions and device of this run (every JSON written carries it)."""
    meta: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch_threads": torch.get_num_threads(),
    }
    for module in ("triton", "transformers"):
        try:
            meta[module] = __import__(module).__version__
        except ImportError:
            meta[module] = None
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        meta["git_commit"] = (commit + (" (uncommitted changes)" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        meta["git_commit"] = None
    return meta
