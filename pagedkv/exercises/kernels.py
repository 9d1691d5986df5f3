"""Checkers for notebook 06's Triton puzzles (the harness, and puzzle 2: the KV scatter).

A puzzle answer is a `@triton.jit` kernel plus a launcher `launch(kernel, *inputs)` that calls
`kernel[grid](...)`. The checker hands the launcher a stand-in for the kernel that counts (and
runs) the launches, compares the outputs with a float64 torch reference on random paged inputs,
and then runs the launcher once more with launches that do nothing: an answer that is still right
then was computed by the launcher, not by the kernel.

Importing this module on a machine without a GPU, before anything imported `triton`, sets
`TRITON_INTERPRET=1`: Triton chooses its interpreter once, when it is first imported, so an
exercise cell that imports this module first works even right after a kernel restart.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # why: see the module docstring

from pagedkv.exercises import CheckResult  # noqa: E402
from pagedkv.platforms import default_device  # noqa: E402

Launch = Callable[..., None]


@dataclass
class Case:
    """One random input of a puzzle: the launcher's arguments (outputs included, pre-filled with a
    sentinel), the outputs by name and the float64 reference of each."""

    args: list[Any]
    outputs: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    description: str
    explain: Callable[[str, tuple[int, ...]], str] | None = None
    """What the first mismatching index of an output (by name) means (e.g. which token owns that cache row)."""


class _KernelStandIn:
    """What the launcher receives instead of the kernel: `stand_in[grid](...)` counts the launch
    and runs it, or (`run=False`) does nothing."""

    def __init__(self, kernel: Any, run: bool) -> None:
        self.kernel, self.run, self.launches = kernel, run, 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        self.launches += 1
        return self.kernel[grid] if self.run else (lambda *args, **kwargs: None)


def not_a_student_kernel(kernel: object) -> str | None:
    """Why `kernel` is not an answer: not a `@triton.jit` function, or one of pagedkv's own."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, (JITFunction, InterpretedFunction)):
        return (
            f"{getattr(kernel, '__name__', repr(kernel))} is a {type(kernel).__name__}, not a @triton.jit kernel: "
            "pass the kernel itself (decorated with @triton.jit), then the launcher."
        )
    module = getattr(kernel.fn, "__module__", None) or ""
    if module.split(".")[0] == "pagedkv":
        return f"{kernel.fn.__name__} is pagedkv's own kernel (from {module}): the puzzle is to write one."
    return None


def _runtime_problem() -> str | None:
    """Why kernels cannot run here (CPU without Triton's interpreter); None when they can."""
    if default_device().type != "cpu":
        return None
    from pagedkv.kernels.common import interpreter_problem

    problem = interpreter_problem()
    return f"Triton cannot run kernels here: {problem}; then restart the kernel." if problem else None


def _last_line(exc: BaseException) -> str:
    """The gist of an error: Triton's compile errors print the source first and the reason last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:200]


def first_mismatch(
    name: str, got: torch.Tensor, expected: torch.Tensor, explain: Callable[[str, tuple[int, ...]], str] | None = None
) -> str | None:
    """'name[i, j] is GOT, expected EXP' for the first differing element (plus `explain(name, index)`);
    None when all agree (floats within 1e-4: the kernels compute in float32, the reference in float64)."""
    got, expected = got.detach().cpu(), expected.cpu()
    if got.is_floating_point():
        ok = torch.isclose(got.double(), expected.double(), rtol=1e-4, atol=1e-4)
    else:
        ok = got == expected
    if bool(ok.all()):
        return None
    index = tuple(int(i) for i in (~ok).nonzero()[0])
    where = f" ({explain(name, index)})" if explain else ""
    at = ", ".join(map(str, index))
    return f"{name}[{at}] is {got[index].item():.4g}, expected {expected[index].item():.4g}{where}"


def check_launches(
    kernels: Sequence[Any], launch: Launch, make_cases: Sequence[Callable[[], Case]], what: str, hint: str
) -> CheckResult:
    """Validate `kernels`, run `launch(*kernels, *case.args)` on each case and compare the outputs."""
    for kernel in kernels:
        reason = not_a_student_kernel(kernel)
        if reason:
            return CheckResult(False, f"{what}: {reason}")
    problem = _runtime_problem()
    if problem:
        return CheckResult(False, f"{what}: {problem}")
    for make_case in make_cases:
        case = make_case()
        stand_ins = [_KernelStandIn(kernel, run=True) for kernel in kernels]
        try:
            with warnings.catch_warnings():  # the interpreter's numpy warns about NaN; the verdict says more
                warnings.simplefilter("ignore", RuntimeWarning)
                launch(*stand_ins, *case.args)
        except Exception as exc:  # a student's kernel may fail in any way; report it in one line
            return CheckResult(False, f"{what}: the launch raised {type(exc).__name__}: {_last_line(exc)}")
        idle = [kernel.fn.__name__ for kernel, s in zip(kernels, stand_ins) if s.launches == 0]
        if idle:
            return CheckResult(False, f"{what}: the launcher never launched {idle[0]} (call kernel[grid](...)).")
        for name, got in case.outputs.items():
            mismatch = first_mismatch(name, got, case.expected[name], case.explain)
            if mismatch:
                return CheckResult(False, f"{what}, {case.description}: {mismatch}.\nHint: {hint}")
    passed = CheckResult(True, f"{what}: {len(make_cases)} random cases match the float64 reference.")
    case = make_cases[0]()
    try:
        launch(*[_KernelStandIn(kernel, run=False) for kernel in kernels], *case.args)
    except Exception:  # a launcher that fails without its kernel does not compute the answer itself
        return passed
    if all(first_mismatch(n, got, case.expected[n]) is None for n, got in case.outputs.items()):
        return CheckResult(False, f"{what}: the launcher gets the right answer without running the kernel; "
                                  "the work belongs in the @triton.jit kernel.")
    return passed


def _scatter_case(seed: int, num_tokens: int, block_size: int, num_kv_heads: int, head_size: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: max(1, num_tokens // 4)]] = -1  # padding tokens
    # The engine's layout: one (2, blocks, block_size, heads, head_size) tensor, K and V as views.
    # Here with a guard block before and after each: a kernel that writes slot -1 (or any slot past
    # the cache) writes into a guard, not into memory it does not own (a crash, later, in Jupyter).
    device = default_device()  # compiled Triton needs GPU tensors; the interpreter takes CPU ones
    guarded = torch.zeros(2, num_blocks + 2, block_size, num_kv_heads, head_size, device=device)
    kv_cache = guarded[:, 1:-1]
    guards = {"before the cache": guarded[:, 0], "after the cache": guarded[:, -1]}  # views: written in place
    expected = torch.zeros(kv_cache.shape, dtype=torch.float64)
    valid = slots >= 0
    expected[0].view(-1, num_kv_heads, head_size)[slots[valid]] = key[valid].double()
    expected[1].view(-1, num_kv_heads, head_size)[slots[valid]] = value[valid].double()
    return Case(
        args=[key.to(device), value.to(device), kv_cache[0], kv_cache[1], slots.to(device)],
        outputs={**guards, "k_cache": kv_cache[0], "v_cache": kv_cache[1]},
        expected={**{name: torch.zeros(g.shape, dtype=torch.float64) for name, g in guards.items()},
                  "k_cache": expected[0], "v_cache": expected[1]},
        description=f"slot_mapping {slots.tolist()}, block_size {block_size}",
        explain=lambda name, index: _cache_row_owner(name, slots.tolist(), index, block_size),
    )


def _cache_row_owner(name: str, slots: list[int], index: tuple[int, ...], block_size: int) -> str:
    """Which token the checker's slot_mapping sends to the cache row at `index`, if any."""
    if name not in ("k_cache", "v_cache"):  # a guard block
        return (f"a write outside the {'K' if index[0] == 0 else 'V'} cache, {name}: a slot of -1 (padding) "
                "must store nothing")
    slot = index[0] * block_size + index[1]
    if slot in slots:
        return f"slot {slot}, where token {slots.index(slot)} writes"
    return f"slot {slot}, which no token writes"


def check_scatter_kernel(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 2: `launch(kernel, key, value, k_cache, v_cache, slot_mapping)` writes token t's
    [heads, head_size] K and V into `(slot // block_size, slot % block_size)`; slot -1 writes nothing."""
    cases = [lambda: _scatter_case(0, 6, 4, 2, 8), lambda: _scatter_case(1, 13, 16, 1, 16)]
    hint = ("block = slot // block_size, offset = slot % block_size, addresses through the cache strides; "
            "a slot of -1 (padding) stores nothing.")
    return check_launches([kernel], launch, cases, "scatter kernel", hint)
