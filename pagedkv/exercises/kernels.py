"""Checkers for notebook 06's Triton puzzles (the harness, and puzzle 2: the KV scatter).

A puzzle answer is a `@triton.jit` kernel plus a launcher `launch(kernel, *inputs)` that calls
`kernel[grid](...)` once. The checker hands the launcher a stand-in for the kernel that counts and
runs the launches, and watches the launcher (on its thread and on every thread it starts):

- every aten op it runs outside the kernel launches is recorded (a `TorchDispatchMode`): a launcher
  may allocate, view and convert whole tensors (.contiguous(), .to()), and size a grid
  (int(seq_lens.max())), nothing else: no math (matmul, softmax, exp, sum, indexing), no copy from
  its inputs into its own buffers, no tensor made from Python values, no write into the checker's
  tensors, no tensor from elsewhere (a precomputed answer); inside a launch only what Triton's
  interpreter itself runs is allowed;
- a call to pagedkv's own kernels or reference, or a read of the checker's frames, is refused.

Only after the launcher has run does the checker compute the float64 reference (nested in each
checker, held by no module-level helper) and compare; a wrong entry gets which rule it broke and a
hint, its worked answer only through `reveal()`. Under Triton's interpreter the kernels' loads and
stores are recorded too (`pagedkv.exercises.memory_access`) and part of the verdict: loads only of
the inputs (and the launcher's own buffers), of the cache rows of the program's own request, every
output row written, no entry stored by two programs. Last, the launcher runs once more with
launches that do nothing: an answer that is still right was not computed by the kernel.

Importing this module on a machine without a GPU, before anything imported `triton`, sets
`TRITON_INTERPRET=1`: Triton chooses its interpreter once, when it is first imported, so an
exercise cell that imports this module first works even right after a kernel restart.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _push_mode
from torch.utils._pytree import tree_leaves

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # why: see the module docstring

from pagedkv.exercises import CheckResult, call_answer, exercise, plain  # noqa: E402
from pagedkv.platforms import default_device  # noqa: E402

Launch = Callable[..., None]

ALLOCATING = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "full",
        "full_like",
        "new_full",
        "ones",
        "ones_like",
        "new_ones",
    }
)
VIEWING = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "as_strided",
        "alias",
        "expand",
        "permute",
        "transpose",
        "t",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "narrow",
        "unbind",
        "split",
        "split_with_sizes",
        "unflatten",
    }
)
COPYING = frozenset({"clone", "_to_copy", "copy_", "fill_", "zero_"})
SIZING = frozenset({"max", "amax", "_local_scalar_dense"})
"""A grid or a loop bound from the longest sequence: int(seq_lens.max())."""
LAUNCHER_OPS = ALLOCATING | VIEWING | COPYING | SIZING
"""The aten ops a launcher may run outside its kernel launches."""
INTERPRETER_OPS = frozenset({"empty", "new_empty", "set_", "copy_", "_to_copy", "clone", "detach", "alias", "view"})
"""The aten ops Triton's interpreter runs while launching a kernel (it copies the tensors to the host and back)."""
_WRITING = frozenset({"copy_", "fill_", "zero_"})
_WHY = {
    "lift_fresh": "makes a tensor from Python values with torch.tensor or torch.from_numpy",
    "detach": "reads tensor data into Python with .numpy() or .detach()",
}


@dataclass
class Case:
    """One random input of a puzzle: the launcher's arguments (outputs included, pre-filled with a
    sentinel), the outputs by name, and how to judge them once the launcher has run."""

    args: list[Any]
    outputs: dict[str, torch.Tensor]
    description: str
    reference: Callable[[], dict[str, torch.Tensor]]
    """The float64 answer of each output, worked out when called (after the launcher ran)."""
    explain: Callable[[str, tuple[int, ...], float, dict[str, torch.Tensor]], tuple[str, Callable[[], str]]]
    """(name, index, the wrong value, the reference) -> (what that value shows, the worked answer of the entry)."""
    inputs: dict[str, torch.Tensor]
    """The inputs by name: the kernels may read them (and tensors the launcher allocates), not write them."""
    access: dict[str, Any] = field(default_factory=dict)
    """More memory rules for `AccessLog.problems` (rows_written, allowed, reasons)."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


@dataclass
class _LaunchWatch:
    """What a launcher did with torch, on all its threads: the first rule each op broke."""

    checker: dict[int, str]
    """Storage of each tensor the checker passed -> the launcher's name for it."""
    outputs: frozenset[int]
    made: set[int] = field(default_factory=set)
    """Storages of the tensors the launcher allocated (or viewed, copied from the checker's)."""
    problems: list[str] = field(default_factory=list)
    active: bool = True
    launching: threading.local = field(default_factory=threading.local)

    def in_launch(self) -> bool:
        return getattr(self.launching, "depth", 0) > 0

    def note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def foreign(self, tensors: list[torch.Tensor]) -> bool:
        """Whether one of `tensors` is neither the checker's nor made by the launcher (nor empty)."""
        return any(t.numel() and _storage(t) not in self.checker and _storage(t) not in self.made for t in tensors)

    def judge(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Note what is wrong with the launcher running aten `op` (outside or inside a kernel launch)."""
        if self.in_launch():
            if op not in INTERPRETER_OPS:
                self.note(
                    f"the kernel calls torch (aten.{op}) while it runs: a @triton.jit kernel computes "
                    "with triton.language only (the interpreter runs any Python; a GPU would not compile it)"
                )
            return
        if op == "set_":  # what Triton's interpreter runs when it launches a kernel
            self.note(
                "the launcher launches a @triton.jit kernel it was not given (aten.set_: the interpreter "
                "copying its arguments): launch only the kernel(s) passed to it"
            )
            return
        if op not in LAUNCHER_OPS:
            why = _WHY.get(op, "computes with torch")
            self.note(
                f"the launcher {why} (aten.{op}) outside the kernel: a launcher only allocates, views and "
                "converts; the work belongs in the @triton.jit kernel"
            )
            return
        if self.foreign(_tensors((args, kwargs))):
            self.note(
                f"the launcher uses a tensor the checker did not give it (aten.{op}): a precomputed "
                "answer cannot pass; work from the inputs"
            )
        elif op in _WRITING and _storage(args[0]) in self.checker:
            written = self.checker[_storage(args[0])]
            kind = "output" if _storage(args[0]) in self.outputs else "input"
            self.note(f"the launcher writes into its {kind} {written} itself (aten.{op}): only the kernel writes")
        elif op == "copy_" and _storage(args[1]) in self.checker:
            self.note(
                f"the launcher copies from its input {self.checker[_storage(args[1])]} into a buffer of its own "
                "(aten.copy_): moving data through the page table (gather, scatter) is the kernel's work"
            )
        for t in _tensors(result):
            self.made.add(_storage(t))


class _Recorder(TorchDispatchMode):
    """Hands each aten op run on this thread to a `_LaunchWatch` (while it is active), then runs it."""

    def __init__(self, watch: _LaunchWatch) -> None:
        super().__init__()
        self.watch = watch

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: torch would wrap `__torch_dispatch__` in `torch._disable_dynamo`, whose first call imports
        torch._dynamo (seconds, in a student's first check); nothing here is compiled."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.watch.active:
            self.watch.judge(func.overloadpacket.__name__, args, kwargs or {}, result)
        return result


@contextmanager
def _watching_torch(watch: _LaunchWatch) -> Iterator[None]:
    """Record the aten ops of this thread, and of every thread started in the block, into `watch`.

    A dispatch mode is per thread: a thread started in the block pushes its own recorder when it
    starts (through `threading.setprofile`, chained with the profiler `watch_calls` set there);
    a thread that outlives the block keeps a recorder that no longer records.
    """
    inner = threading.getprofile()

    def start_thread(
        frame: FrameType, event: Literal["call", "return", "c_call", "c_return", "c_exception"], arg: Any
    ) -> None:
        _push_mode(_Recorder(watch))
        sys.setprofile(inner)
        if inner is not None:
            inner(frame, event, arg)

    threading.setprofile(start_thread)
    try:
        with _Recorder(watch):
            yield
    finally:
        watch.active = False
        threading.setprofile(inner)


class _KernelStandIn:
    """What the launcher receives instead of the kernel: `stand_in[grid](...)` counts the launch,
    checks its tensors, and runs it (`run=False`: does nothing)."""

    def __init__(self, kernel: Any, run: bool, watch: _LaunchWatch) -> None:
        self.kernel, self.run, self.watch, self.launches = kernel, run, watch, 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launched(*args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            if not self.run:
                return None
            if self.watch.foreign(_tensors((args, kwargs))):
                self.watch.note(
                    f"the launcher passes {self.kernel.fn.__name__} a tensor the checker did not give "
                    "it and it did not allocate: a precomputed answer cannot pass"
                )
            local = self.watch.launching
            local.depth = getattr(local, "depth", 0) + 1
            # Triton's own code may read frames (its first launch imports lazily; namedtuple does) and
            # runs much Python under the interpreter: the call watch pauses while the kernel runs.
            profiler = sys.getprofile()
            sys.setprofile(None)
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                sys.setprofile(profiler)
                local.depth -= 1

        return launched


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
    used = _package_code_used(kernel.fn, (JITFunction, InterpretedFunction))
    if used:
        return f"{kernel.fn.__name__} calls {used}, pagedkv's own: the puzzle is to write the kernel yourself."
    return None


def _package_code_used(fn: Any, jit_types: tuple[type, ...], seen: set[int] | None = None) -> str | None:
    """The first pagedkv kernel or module that `fn` (a kernel's Python function) or one of the
    @triton.jit helpers it calls refers to by name; None if none. Inside a kernel the call watch
    is paused (Triton's own code runs there), so this is read from the code instead."""
    seen = seen if seen is not None else set()
    if id(fn) in seen or not hasattr(fn, "__code__"):
        return None
    seen.add(id(fn))
    scope = dict(getattr(fn, "__globals__", {}))
    scope.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    codes, names = [fn.__code__], set[str]()
    while codes:  # the names of nested code objects too (comprehensions, lambdas)
        code = codes.pop()
        names.update(code.co_names, code.co_freevars)
        codes += [c for c in code.co_consts if hasattr(c, "co_names")]
    for name in sorted(names):
        value = scope.get(name)
        inner = getattr(value, "fn", None) if isinstance(value, jit_types) else None
        home = getattr(inner if inner is not None else value, "__module__", None) or getattr(value, "__name__", "")
        if isinstance(value, (*jit_types, ModuleType)) and str(home).split(".")[0] == "pagedkv":
            return f"{name} (from {home})"
        if inner is not None:
            found = _package_code_used(inner, jit_types, seen)
            if found:
                return found
    return None


def _runtime_problem() -> str | None:
    """Why kernels cannot run here (no Triton, or a CPU without Triton's interpreter); None when they can."""
    from pagedkv.kernels import HAS_TRITON

    if not HAS_TRITON:
        return 'Triton is not installed: pip install triton (or "pagedkv[notebooks]"), then restart the kernel.'
    if default_device().type != "cpu":
        return None
    from pagedkv.kernels.common import interpreter_problem

    problem = interpreter_problem()
    return f"Triton cannot run kernels here: {problem}; then restart the kernel." if problem else None


def _last_line(exc: BaseException) -> str:
    """The gist of an error: Triton's compile errors print the source first and the reason last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:200]


def _package_functions() -> list[Callable[..., Any]]:
    """pagedkv's own kernels and attention reference: a launcher that calls one hands the work back."""
    import pagedkv.kernels as K
    from pagedkv.attention.backends.torch_ref import paged_attention_reference
    from pagedkv.kernels.split_kv import merge_splits

    return [K.reshape_and_cache, K.unified_attention, K.mla_decode_attention, merge_splits, paged_attention_reference]


def first_mismatch(got: torch.Tensor, expected: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first element of `got` that differs from `expected` (floats: by more than 1e-4,
    as the kernels compute in float32 and the reference in float64); None when all agree."""
    got, expected = got.detach().cpu(), expected.cpu()
    if got.is_floating_point():
        ok = torch.isclose(got.double(), expected.double(), rtol=1e-4, atol=1e-4)
    else:
        ok = got == expected
    if bool(ok.all()):
        return None
    return tuple(int(i) for i in (~ok).nonzero()[0])


ACCESS_HINT = (
    "a kernel loads only what its program needs (mask the loads past seq_len: those rows hold "
    "another request's keys, or nothing) and stores every entry of its output rows, each once."
)


@contextmanager
def _recording_accesses(named: dict[str, torch.Tensor], log: list[Any] | None) -> Iterator[Any]:
    """`record_accesses(named)` when `log` is asked for and Triton runs interpreted (compiled kernels
    cannot be watched: the memory rules are then checked on the CPU only); else yields None."""
    from pagedkv.kernels.common import interpreting

    if log is None or not interpreting():
        yield None
        return
    from pagedkv.exercises.memory_access import record_accesses

    with record_accesses(named=named) as access_log:
        yield access_log


def _access_problems(log: Any, case: Case) -> list[str]:
    """The memory rules a case's kernels broke: a load outside the inputs (and the launcher's own
    buffers), a store outside the outputs, and the case's own rules (`case.access`)."""
    scratch = [name for name in log.tensors if name not in log.named]  # what the launcher allocated
    outputs = [name for name in case.outputs if name in log.tensors]
    return log.problems(reads=[*case.inputs, *scratch], writes=[*outputs, *scratch], **case.access)


@functools.cache
def _warm_up() -> None:
    """Enter a dispatch mode once before any watched run: the first one imports parts of torch, and
    those imports read frames (typing), which the call watch would blame on the student's launcher."""
    with _Recorder(_LaunchWatch({}, frozenset(), active=False)):
        torch.zeros(1).clone().numpy()


def _run_launcher(
    kernels: Sequence[Any], launch: Launch, case: Case, what: str, run: bool, log: list[Any] | None = None
) -> tuple[list[_KernelStandIn], CheckResult | None]:
    """`launch(*stand-ins, *case.args)` watched (torch ops, threads, package calls); the stand-ins
    and the rejection, if any. With `log` (a list), the kernels' loads and stores are recorded into
    its one entry, an `AccessLog` (only under Triton's interpreter)."""
    names = list(inspect.signature(launch).parameters)[len(kernels) :] if callable(launch) else []
    names += [f"argument {i}" for i in range(len(names), len(case.args))]
    checker = {_storage(t): name for name, t in zip(names, case.args) if isinstance(t, torch.Tensor)}
    _warm_up()
    watch = _LaunchWatch(checker, frozenset(_storage(t) for t in case.outputs.values()))
    stand_ins = [_KernelStandIn(kernel, run, watch) for kernel in kernels]

    def watched() -> BaseException | None:
        with warnings.catch_warnings(), _watching_torch(watch):  # the interpreter's numpy warns about NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                launch(*stand_ins, *case.args)
            except Exception as exc:  # a student's kernel may fail in any way; report it in one line
                return exc
        return None

    written = {name: t for name, t in case.outputs.items() if any(t is arg for arg in case.args)}  # not guards
    kernel = what if what.endswith("kernel") else f"{what} kernel"
    with _recording_accesses({**case.inputs, **written}, log) as access_log:
        error, rejected = call_answer(watched, [], _package_functions(), f"the {kernel}", "the launcher")
    if log is not None and access_log is not None:
        log.append(access_log)
    if rejected is not None:
        return stand_ins, CheckResult(False, f"{what}: {rejected.message}")
    if watch.problems:
        return stand_ins, CheckResult(False, f"{what}: {watch.problems[0]}.")
    if error is not None:
        return stand_ins, CheckResult(False, f"{what}: the launch raised {type(error).__name__}: {_last_line(error)}")
    return stand_ins, None


def check_launches(
    kernels: Sequence[Any], launch: Launch, make_cases: Sequence[Callable[[], Case]], what: str, hint: str
) -> CheckResult:
    """Validate `kernels`, run the launcher on each case (watched), then compare with the reference."""
    problem = _runtime_problem()
    if problem:
        return CheckResult(False, f"{what}: {problem}")
    for kernel in kernels:
        reason = not_a_student_kernel(kernel)
        if reason:
            return CheckResult(False, f"{what}: {reason}")
    for number, make_case in enumerate(make_cases):
        case = make_case()
        before = {name: t.detach().clone() for name, t in case.outputs.items()}
        logs: list[Any] = []
        stand_ins, rejected = _run_launcher(kernels, launch, case, what, run=True, log=logs)
        if rejected is not None:
            return rejected
        for kernel, stand_in in zip(kernels, stand_ins):
            name, n = kernel.fn.__name__, stand_in.launches
            if n == 0:
                return CheckResult(False, f"{what}: the launcher never launched {name} (call kernel[grid](...)).")
            if n > 1:
                return CheckResult(
                    False,
                    f"{what}: the launcher launched {name} {n} times; launch it once, "
                    "with a grid of programs, not in a Python loop.",
                )
        for name, got in case.outputs.items():
            try:  # exactly a tensor still: a class given to it could make the comparisons below lie
                plain(got, torch.empty(0))
            except TypeError:
                return CheckResult(
                    False, f"{what}: the launcher made {name} a {type(got).__name__}; write into it as it is."
                )
        if number == 0 and not any(_changed(got, before[name]) for name, got in case.outputs.items()):
            # The notebook's skeleton (a kernel of TODO comments) stores nothing: Run All spends no try on it.
            return CheckResult(
                False,
                f"{what}: not answered yet: the kernel stores nothing (write its tl.store, then run the cell "
                "again; no try is counted).",
                answered=False,
            )
        expected = case.reference()  # only now, after the student's code has run
        for name, got in case.outputs.items():
            index = first_mismatch(got, expected[name])
            if index is not None:
                value = float(got.detach().cpu()[index])
                shows, work = case.explain(name, index, value, expected)
                at = ", ".join(map(str, index))
                return CheckResult(
                    False,
                    f"{what}: {name}[{at}] is {value:.4g}{shows}.\nCase: {case.description}.\nHint: {hint}",
                    reveal=work,
                )
        problems = _access_problems(logs[0], case) if logs else []
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return CheckResult(
                False,
                f"{what}: the right values, but {problems[0]}{more}.\nCase: {case.description}.\nHint: {ACCESS_HINT}",
                # partial binds this try's `problems` now (a closure over the loop variable would not).
                reveal=functools.partial("\n".join, ["Every memory rule the kernel broke:", *problems]),
            )
    case = make_cases[0]()
    _, rejected = _run_launcher(kernels, launch, case, what, run=False)
    expected = case.reference()
    if rejected is None and all(first_mismatch(got, expected[n]) is None for n, got in case.outputs.items()):
        return CheckResult(
            False,
            f"{what}: the launcher gets the right answer without running the kernel; "
            "the work belongs in the @triton.jit kernel.",
        )
    return CheckResult(True, f"{what}: {len(make_cases)} random cases match the float64 reference.")


def _changed(after: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether any element of an output differs from what it held before the launch (NaN = NaN)."""
    return not torch.equal(after.detach().cpu().nan_to_num(0.5), before.cpu().nan_to_num(0.5)) or bool(
        (after.detach().cpu().isnan() != before.cpu().isnan()).any()
    )


def unwritten(value: float, sentinel: float) -> str:
    """' (never written: ...)' when `value` is the sentinel an output starts as, else ''."""
    same = value != value if sentinel != sentinel else value == sentinel
    return f" (never written: the output starts as {sentinel:g})" if same else ""


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
    slot_list = slots.tolist()

    def reference() -> dict[str, torch.Tensor]:
        cache = torch.zeros(kv_cache.shape, dtype=torch.float64)
        valid = slots >= 0
        cache[0].view(-1, num_kv_heads, head_size)[slots[valid]] = key[valid].double()
        cache[1].view(-1, num_kv_heads, head_size)[slots[valid]] = value[valid].double()
        return {
            **{name: torch.zeros(g.shape, dtype=torch.float64) for name, g in guards.items()},
            "k_cache": cache[0],
            "v_cache": cache[1],
        }

    def explain(name: str, index: tuple[int, ...], got: float, expected: dict[str, torch.Tensor]) -> tuple[str, Any]:
        if name not in ("k_cache", "v_cache"):  # a guard block
            which = "K" if index[0] == 0 else "V"
            return (
                f" (a write outside the {which} cache, {name}: a slot of -1 (padding) must store nothing)",
                lambda: (
                    f"Nothing may be written {name}: tokens with slot -1 ({slot_list}) store nothing, "
                    "so their program returns before any tl.store."
                ),
            )
        slot = index[0] * block_size + index[1]
        source = key if name == "k_cache" else value
        row = f"{name}[{index[0]}, {index[1]}] is slot {index[0]} * {block_size} + {index[1]} = {slot}"
        whose = [t for t in range(num_tokens) if abs(float(source[(t, *index[2:])]) - got) < 1e-6]
        if whose and slot_list[whose[0]] < 0:
            shows = f"; that is token {whose[0]}'s value, a padding token (slot -1): it must store nothing"
        elif whose:
            shows = f"; that is token {whose[0]}'s value: check slot // block_size and slot % block_size"
        else:
            shows = ""
        if slot not in slot_list:
            return (
                f" (slot {slot}, which no token writes: it must stay 0{shows})",
                lambda: f"{row}; no token of slot_mapping {slot_list} has slot {slot}, so that row stays at 0.",
            )
        token = slot_list.index(slot)
        head, dim = index[2:]
        return (
            f" (slot {slot}, where token {token} writes{shows})",
            lambda: (
                f"token {token} has slot {slot} = block {slot // block_size}, row {slot % block_size} "
                f"({slot} // {block_size}, {slot} % {block_size}), so {name}[{', '.join(map(str, index))}] "
                f"= {'key' if name == 'k_cache' else 'value'}[{token}, {head}, {dim}] = "
                f"{float(source[token, head, dim]):.4g}."
            ),
        )

    key_d, value_d, slots_d = (t.to(device, copy=True) for t in (key, value, slots))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    return Case(
        args=[key_d, value_d, k_cache, v_cache, slots_d],
        outputs={**guards, "k_cache": k_cache, "v_cache": v_cache},
        description=f"slot_mapping {slot_list}, block_size {block_size}",
        reference=reference,
        explain=explain,
        inputs={"key": key_d, "value": value_d, "slot_mapping": slots_d},
    )


@exercise("06: puzzle 2, scatter K/V by slot mapping")
def check_scatter_kernel(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 2: `launch(kernel, key, value, k_cache, v_cache, slot_mapping)` writes token t's
    [heads, head_size] K and V into `(slot // block_size, slot % block_size)`; slot -1 writes nothing."""
    cases = [lambda: _scatter_case(0, 6, 4, 2, 8), lambda: _scatter_case(1, 13, 16, 1, 16)]
    hint = (
        "block = slot // block_size, offset = slot % block_size, addresses through the cache strides; "
        "a slot of -1 (padding) stores nothing."
    )
    return check_launches([kernel], launch, cases, "scatter kernel", hint)
