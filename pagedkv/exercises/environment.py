"""Notebook 00 (start here): what this machine offers, and the first exercise.

`environment_report()` lists versions and devices; `check_backend_choice(llm, answer)` checks
the student's guess of the attention backend the engine picked for a layer, and explains the
selector's decision (the platform's priority list and every rejected backend's reasons).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import dataclass

import torch

from pagedkv.attention.selector import ENV_VAR, registered_backends
from pagedkv.engine.llm import LLM
from pagedkv.exercises import CheckResult
from pagedkv.exercises.backends import selector_report
from pagedkv.platforms import default_device, get_platform


def _package_version(module: str) -> str:
    """`module.__version__`, or why it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install raising something else)
        return f"not available ({type(exc).__name__})"


def environment_report() -> dict[str, str]:
    """What the workbook can use here: Python, torch, the device, triton, flash-attn."""
    device = default_device()
    report = {
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "default device": str(device),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
        report["cuda (torch built with)"] = str(torch.version.cuda)
    else:
        report["gpu"] = "none visible"
    report["triton"] = _package_version("triton")
    report["flash-attn"] = _package_version("flash_attn")
    flavour = _flash_attn_flavour()
    if flavour is not None:
        report["flash-attn"] += f" (the FLASH_ATTN backend would use flash-attn {flavour})"
    return report


def _flash_attn_flavour() -> int | None:
    """Which flash-attn the FLASH_ATTN backend would use here (4 or 2), or None."""
    try:
        from pagedkv.attention.backends.flash_attn import flash_attn_version
    except ImportError:
        return None
    return flash_attn_version()


@dataclass(frozen=True)
class NotebookInfo:
    """One notebook of the workbook and what it needs to run."""

    name: str
    topic: str
    needs: str
    """"cpu" (runs anywhere), "triton", "cuda" or "flash-attn" (a CUDA GPU with flash-attn)."""
    later: bool = False
    """Planned, not written yet."""


WORKBOOK: list[NotebookInfo] = [
    NotebookInfo("00_start_here", "this notebook: the machine, the map, a first engine", "cpu"),
    NotebookInfo("01_the_model_file", "LlamaAttention: qkv, RoPE, attn, o_proj; MHA / GQA / MQA; TP heads", "cpu"),
    NotebookInfo("02_paged_kv_cache", "block pool, block tables, slot mapping, the null block", "cpu"),
    NotebookInfo("03_the_forward_context", "layers find per-step data by name; the torch.ops.pagedkv ops", "cpu"),
    NotebookInfo("04_attention_backends", "backend / builder / impl; the selector; write your own backend", "cpu"),
    NotebookInfo("05_attention_groups_and_metadata", "KV cache groups, attention groups, common metadata", "cpu"),
    NotebookInfo("06_triton_kernels", "paged attention and cache writes as Triton kernels", "triton"),
    NotebookInfo("07_flash_attention", "the FLASH_ATTN backend on a GPU", "flash-attn"),
    NotebookInfo("08_cuda_graphs_and_torch_compile",
                 "CUDA graph modes and their lowering, the torch.compile split (graphs timed on a GPU)", "cpu"),
    NotebookInfo("09_serving_end_to_end", "continuous batching, chunked prefill, preemption, throughput", "cpu"),
]


def runs_here(needs: str) -> str:
    """How a notebook with requirement `needs` runs on this machine, in a few words."""
    cuda = torch.cuda.is_available()
    if needs == "cpu":
        return "yes" + (" (on the GPU)" if cuda else " (on the CPU)")
    if needs == "triton":
        if "not available" in _package_version("triton"):
            return "no: triton is not installed"
        if cuda:
            return "yes (native kernels)"
        return "yes, in the Triton interpreter (TRITON_INTERPRET=1): slow, tiny shapes"
    if needs == "cuda":
        return "yes" if cuda else "no: needs a CUDA GPU"
    if needs == "flash-attn":
        if not cuda:
            return "no: needs a CUDA GPU with flash-attn"
        flavour = _flash_attn_flavour()
        return f"yes (flash-attn {flavour})" if flavour is not None else "no: flash-attn is not installed"
    raise ValueError(f"Unknown requirement {needs!r}.")


def check_backend_choice(llm: LLM, answer: object, layer_name: str = "model.layers.0.self_attn.attn") -> CheckResult:
    """Is `answer` the name of the backend the engine chose for `layer_name`? Explain the choice."""
    if answer is ...:
        return CheckResult(False, "Replace `...` with a backend name (a str), e.g. answer = \"SOME_NAME\".")
    if layer_name not in llm.runner.attn_layers:
        return CheckResult(False, f"{layer_name!r} is not an attention layer; they are {list(llm.runner.attn_layers)}.")
    chosen = llm.runner.attn_layers[layer_name].attn_backend.get_name()
    report = selector_report(llm, layer_name)
    device_type = llm.config.device.type
    forced = llm.config.attention_backend or os.environ.get(ENV_VAR)
    if forced:
        why = f"the engine was told to use {forced!r} (LLM(attention_backend=...) or ${ENV_VAR})"
    else:
        priority = list(get_platform(llm.config.device).backend_priority)
        tried_before = priority[: priority.index(chosen)] if chosen in priority else []
        rejected = [f"{n} ({'; '.join(report[n])})" for n in tried_before if n in report]
        why = f"on {device_type} the selector tries {priority} in order and takes the first that can serve the layer"
        if rejected:
            why += "; rejected before it: " + ", ".join(rejected)
    if not isinstance(answer, str):
        return CheckResult(False, f"Give the backend's name as a str (one of {registered_backends()}), got {answer!r}.")
    if answer == chosen:
        return CheckResult(True, f"{chosen} serves {layer_name!r}: {why}.")
    if answer.upper() == chosen:
        return CheckResult(False, f"Almost: backend names are upper case, {chosen!r}.")
    if answer not in report:
        return CheckResult(
            False, f"{answer!r} is not a registered backend; the registry holds {registered_backends()}."
        )
    if report[answer]:
        return CheckResult(False, f"{answer} cannot serve this layer here: {'; '.join(report[answer])}.")
    return CheckResult(
        False,
        f"{answer} could serve this layer, but it is not the one chosen: {why}. Look at "
        f"llm.model.model.layers[0].self_attn.attn to see the choice.",
    )
