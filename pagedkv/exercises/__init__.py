"""Workbook exercises: each notebook's exercise calls a checker here.

How a checker works, and what it promises a student:

- It runs the student's function on cases it makes up (configurations, traces, tensors), including
  ones no helper of the package accepts, or reads the answer off a live engine. The expected answer
  is computed inside the checker, after the student's code has run: it is stored nowhere a student
  could import or read it from (not in a module, not in a frame the student's code can reach).
- An answer that hands the work back to the package (its function itself, or a call to it on any
  thread) is turned away, and so is code that reads the checker's frames.
- A wrong answer is told which rule or invariant it broke, with a hint, never the expected value.
  After three wrong tries of one exercise, `reveal()` shows the answer of the case that failed,
  worked out step by step.

    @exercise("02: the next step's slot mapping")
    def check_next_slot_mapping(llm, answer) -> CheckResult: ...
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ParamSpec

PASS_MARK, FAIL_MARK = "✓", "✗"
"""Text symbols (U+2713, U+2717), found in common text fonts: no emoji font needed to show them."""
REVEAL_AFTER = 3
"""Wrong tries of one exercise after which `reveal()` shows the worked answer."""


@dataclass
class CheckResult:
    """Outcome of one exercise check; renders as one line in a notebook.

    A failing result may carry `reveal`: a function that works out the answer of the case that
    failed (called only by `reveal()`, after enough tries, so the answer is computed only then).
    """

    ok: bool
    message: str
    reveal: Callable[[], str] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"{PASS_MARK if self.ok else FAIL_MARK} {self.message}"

    def __bool__(self) -> bool:
        return self.ok


def compare(what: str, got: object, expected: object, hint: str = "") -> CheckResult:
    """Equal -> ok; else which entry (for lists) is off, the hint, and the expected value only in `reveal`."""
    if got == expected:
        return CheckResult(True, f"{what}: correct.")
    detail = f"{got!r} is not it"
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            detail = f"the answer has one entry per request: {len(expected)} entries, you gave {len(got)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            detail = f"entry {i} ({got[i]!r}) is wrong"
    return CheckResult(
        False,
        f"{what}: {detail}." + (f" Hint: {hint}" if hint else ""),
        reveal=lambda: f"{what} = {expected!r}" + (f" ({hint})" if hint else ""),
    )


@dataclass
class _Tries:
    """Wrong tries per exercise in this kernel, and the worked answer of the latest failure."""

    wrong: dict[str, int] = field(default_factory=dict)
    last_title: str | None = None
    last_reveal: Callable[[], str] | None = None


_TRIES = _Tries()
P = ParamSpec("P")


def exercise(title: str) -> Callable[[Callable[P, CheckResult]], Callable[P, CheckResult]]:
    """Make a checker count wrong tries: after `REVEAL_AFTER` of them its message offers `reveal()`."""

    def decorate(check: Callable[P, CheckResult]) -> Callable[P, CheckResult]:
        @functools.wraps(check)
        def counted(*args: P.args, **kwargs: P.kwargs) -> CheckResult:
            result = check(*args, **kwargs)
            if result.ok:
                _TRIES.wrong.pop(title, None)
                return result
            tries = _TRIES.wrong[title] = _TRIES.wrong.get(title, 0) + 1
            _TRIES.last_title, _TRIES.last_reveal = title, result.reveal
            if result.reveal is not None and tries >= REVEAL_AFTER:
                result.message += f" (Try {tries}. Stuck? `reveal()` works out this case for you.)"
            return result

        return counted

    return decorate


def reveal() -> None:
    """Print the worked answer of the case the last failing check tried, once it failed three times."""
    title, work = _TRIES.last_title, _TRIES.last_reveal
    if title is None:
        print("Nothing to reveal: no check has failed yet in this kernel.")
    elif work is None:
        print(f"{title}: this failure has nothing to work out (it is about the form of the answer).")
    elif (tries := _TRIES.wrong.get(title, 0)) < REVEAL_AFTER:
        print(
            f"{title}: {tries} wrong tr{'y' if tries == 1 else 'ies'} so far; "
            f"reveal() works out the answer after {REVEAL_AFTER}. Reread the hint and try again."
        )
    else:
        print(f"{title}, worked out:\n{work()}")


FRAME_READERS = frozenset({sys._getframe, sys._current_frames})
"""Builtins that reach the checker's frames (inspect.currentframe / stack call them too)."""


class PackageCalled(Exception):
    """Raised in a student's code, on whatever thread, that called a package function under watch."""


def _tripwire(*args: Any, _pagedkv_note: Callable[[], None], **kwargs: Any) -> None:
    """Code swapped into a watched function for the length of a check: it runs with that function's
    globals, so it looks nothing up by name; `_pagedkv_note` (a keyword default set on the function)
    notes the call and raises PackageCalled."""
    _pagedkv_note()


@contextmanager
def _tripwires(functions: Iterable[Callable[..., Any]], note: Callable[[str], None]) -> Iterator[None]:
    """Within the block, calling one of `functions` from any thread, even one started long before
    (a thread pool made earlier), notes it and raises PackageCalled: each function's code is swapped
    for `_tripwire`'s. Functions with a closure cannot take that code (Python checks the free
    variables); the profiler of `watch_calls` still sees those."""
    swapped: list[tuple[Any, Any, dict[str, Any] | None]] = []

    def noter(name: str) -> Callable[[], None]:
        def noted() -> None:
            note(name)
            raise PackageCalled(f"{name} was called during a check")

        return noted

    try:
        for f in {id(f): f for f in functions if hasattr(f, "__code__") and not f.__closure__}.values():
            swapped.append((f, f.__code__, f.__kwdefaults__))
            f.__kwdefaults__ = {**(f.__kwdefaults__ or {}), "_pagedkv_note": noter(f.__qualname__)}
            f.__code__ = _tripwire.__code__
        yield
    finally:
        for f, code, kwdefaults in reversed(swapped):
            f.__code__, f.__kwdefaults__ = code, kwdefaults


@contextmanager
def watch_calls(functions: Iterable[Callable[..., Any]]) -> Iterator[list[str]]:
    """Within the block, note every call (direct or nested, on any thread) to one of `functions`,
    and every call of a builtin that reads frames.

    Yields a list that fills with the qualified names of what was called. The checkers use it to
    turn away an answer that hands the work back to the package's own implementation, however it
    got hold of it (an import under another name, a wrapper, super(), a thread pool), or that looks
    up the stack. Two nets: a profiler on this thread and on threads started in the block (all
    threads on Python 3.12+), which matches code objects, so a copy of the source is not noticed;
    and tripwires (`_tripwires`) that catch a call from a thread started earlier: such a call
    raises PackageCalled instead of running. A profiler already set (cProfile) is paused in the block.
    """
    functions = list(functions)
    codes = {f.__code__: f.__qualname__ for f in functions if hasattr(f, "__code__")}
    called: list[str] = []

    def note(name: str) -> None:
        if name not in called:
            called.append(name)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            note(codes[frame.f_code])
        elif event == "c_call" and arg in FRAME_READERS:
            note(f"{arg.__module__}.{arg.__name__} (reading the checker's frames)")  # type: ignore[attr-defined]

    set_all = getattr(threading, "setprofile_all_threads", None)  # Python 3.12+
    previous, previous_threads = sys.getprofile(), threading.getprofile()
    with _tripwires(functions, note):
        try:  # set inside the try: an interrupt between the two calls still restores both
            (set_all or threading.setprofile)(profile)
            sys.setprofile(profile)
            yield called
        finally:
            sys.setprofile(previous)
            if set_all is not None:
                set_all(None)
            threading.setprofile(previous_threads)


def package_answer(answer: object, functions: Iterable[Callable[..., Any]], what: str) -> CheckResult | None:
    """A rejection if `answer` is not a function (its result was passed instead) or is one of the
    package's `functions` itself, else None."""
    if not callable(answer):
        return CheckResult(False, f"Pass your function itself (not its result), got {answer!r}.")
    for function in functions:
        if answer is function:
            return CheckResult(False, f"That is pagedkv's own {function.__qualname__}; write {what} yourself.")
    return None


def used_package(called: list[str], what: str) -> CheckResult:
    """The rejection of an answer that called the package's implementation (`called` from watch_calls)."""
    return CheckResult(False, f"Your answer calls {', '.join(called)}; write {what} yourself.")


def call_answer(
    fn: Callable[..., Any], args: Sequence[Any], package: Iterable[Callable[..., Any]], what: str, call: str
) -> tuple[Any, CheckResult | None]:
    """Call a student's answer, `fn(*args)`, watching for the package's `package` functions.

    Returns (its result, None), or (None, the rejection): it called the package's implementation
    of `what` (`used_package`) or read frames, or it raised (`call` names the call in the message).
    Call it before the checker computes the expected answer, so no frame holds that answer yet.
    """
    try:
        with watch_calls(package) as called:
            got = fn(*args)
    except Exception as exc:  # noqa: BLE001  (the student's code may raise anything)
        if called:
            return None, used_package(called, what)
        first_line = (str(exc).splitlines() or [""])[0]
        return None, CheckResult(False, f"{call} raised {type(exc).__name__}: {first_line}.")
    return got, (used_package(called, what) if called else None)


def call_on_cases(
    fn: Callable[..., Any],
    cases: Sequence[Sequence[Any]],
    package: Iterable[Callable[..., Any]],
    what: str,
    call: Callable[[Sequence[Any]], str],
) -> tuple[list[Any], CheckResult | None]:
    """`fn(*case)` for every case (through `call_answer`), all before any expected answer exists.

    Returns (the results, None), or (the results so far, the first rejection). `call(case)` names
    the call in a message.
    """
    results: list[Any] = []
    for case in cases:
        got, rejected = call_answer(fn, case, package, what, call(case))
        if rejected is not None:
            return results, rejected
        results.append(got)
    return results, None
