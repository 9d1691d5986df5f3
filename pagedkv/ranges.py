"""Named ranges around the phases of an engine step, for profilers (torch.profiler, Nsight Systems).

    with phase_range("forward"):        # in pagedkv/worker/model_runner.py
        hidden = self._forward(...)
    with phase_range("book", step=12):  # in pagedkv/engine/llm.py: which step it books

One step of `LLM.step()` is cut into PHASES: the scheduler plans it (schedule), the runner brings
its request rows up to date and gathers the inputs (prepare), runs the model (forward), the
sampler draws its tokens (sample), the host waits for them to reach it (wait) and books them
(book). Under async scheduling, step N+1's schedule .. sample run before step N's wait and book,
while the GPU still runs step N: a timeline of these ranges shows that overlap.

A range is named "pagedkv.<phase>#<step>" (the engine's number of the step it belongs to) or
"pagedkv.<phase>" (the runner's phases, which do not know it: pagedkv.trace.profile gives them the
number of the schedule range before them on their thread), and "pagedkv.step" for a whole call.

Cost: a `torch.profiler.record_function` costs ~8 us even when no profiler runs (measured on a
busy 2-core machine), about as much as a small kernel launch, and a step opens 8 ranges. So a range
is opened only while a profiler runs: otherwise `phase_range` costs its check,
`torch.autograd._profiler_enabled()`, ~0.4 us a range on the same machine. An NVTX range is
pushed (for nsys, which starts no torch profiler) only on CUDA and with PAGEDKV_NVTX=1 set,
as vLLM's own NVTX ranges are behind an environment switch (vllm/envs.py,
VLLM_NVTX_SCOPES_FOR_PROFILING).
"""

from __future__ import annotations

import os
from types import TracebackType

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "wait", "book")
"""The phases of one engine step, in the order the host runs them."""
PREFIX = "pagedkv."
"""What every range name starts with (other annotations in a trace are not the engine's)."""
STEP_RANGE = PREFIX + "step"
"""The range around one whole `LLM.step()` call (it books one step and may launch the next)."""
NVTX = os.environ.get("PAGEDKV_NVTX") == "1" and torch.cuda.is_available()
"""Push NVTX ranges too (read once, at import: set it before Python starts, as for nsys)."""


def range_name(phase: str, step: int | None = None) -> str:
    """The range's name: "pagedkv.forward", or "pagedkv.book#12" for a phase of step 12."""
    return PREFIX + phase if step is None else f"{PREFIX}{phase}#{step}"


class phase_range:  # noqa: N801  (used like a function: `with phase_range("forward"):`)
    """A profiler range around one phase of a step; nothing at all while no profiler runs.

    A class rather than a generator-based context manager: it is entered a few times per step,
    and a generator's set-up costs as much again as the check whether a profiler runs.
    """

    __slots__ = ("_name", "_record", "_nvtx")

    def __init__(self, phase: str, step: int | None = None) -> None:
        self._name: str | None = None
        self._record: torch.profiler.record_function | None = None
        self._nvtx = False
        if NVTX or torch.autograd._profiler_enabled():
            self._name = range_name(phase, step)

    def __enter__(self) -> None:
        if self._name is None:
            return
        if torch.autograd._profiler_enabled():
            self._record = torch.profiler.record_function(self._name)
            self._record.__enter__()
        if NVTX:
            torch.cuda.nvtx.range_push(self._name)
            self._nvtx = True

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        if self._record is not None:
            self._record.__exit__(kind, error, tb)
