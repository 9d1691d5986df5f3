"""Workbook exercises: each notebook's exercise calls a checker here, which recomputes the
answer from the live engine or on cases of its own choosing (never a stored value), turns away
the package's own implementation handed back as the answer, and says what is wrong in one line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any


@dataclass
class CheckResult:
    """Outcome of one exercise check; renders as one line in a notebook."""

    ok: bool
    message: str

    def __repr__(self) -> str:
        return ("✅ " if self.ok else "❌ ") + self.message

    def __bool__(self) -> bool:
        return self.ok


def compare(what: str, got: object, expected: object, hint: str = "") -> CheckResult:
    """Equal -> ok; else a message naming the first difference (for lists) and a hint."""
    if got == expected:
        return CheckResult(True, f"{what}: correct.")
    detail = f"expected {expected!r}, got {got!r}"
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            detail = f"expected {len(expected)} entries, got {len(got)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            detail = f"entry {i} is {got[i]!r}, expected {expected[i]!r}"
    return CheckResult(False, f"{what}: {detail}." + (f" Hint: {hint}" if hint else ""))


@contextmanager
def watch_calls(functions: Iterable[Callable[..., Any]]) -> Iterator[list[str]]:
    """Within the block, note every call (direct or nested) to one of `functions`.

    Yields a list that fills with the qualified names of those called. The checkers use it to
    turn away an answer that hands the work back to the package's own implementation, however it
    got hold of it (an import under another name, a wrapper, super()). It matches code objects, so
    a copy of the source is not noticed. A profiler already set (cProfile) is paused in the block.
    """
    codes = {f.__code__: f.__qualname__ for f in functions if hasattr(f, "__code__")}
    called: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes and codes[frame.f_code] not in called:
            called.append(codes[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(previous)


def package_answer(answer: object, functions: Iterable[Callable[..., Any]], what: str) -> CheckResult | None:
    """A rejection if `answer` is one of the package's `functions` itself, else None."""
    for function in functions:
        if answer is function:
            return CheckResult(False, f"That is pagedkv's own {function.__qualname__}; write {what} yourself.")
    return None


def used_package(called: list[str], what: str) -> CheckResult:
    """The rejection of an answer that called the package's implementation (`called` from watch_calls)."""
    return CheckResult(False, f"Your answer calls pagedkv's own {', '.join(called)}; write {what} yourself.")


def call_answer(
    fn: Callable[..., Any], args: Sequence[Any], package: Iterable[Callable[..., Any]], what: str, call: str
) -> tuple[Any, CheckResult | None]:
    """Call a student's answer, `fn(*args)`, watching for the package's `package` functions.

    Returns (its result, None), or (None, the rejection): it called the package's implementation
    of `what` (`used_package`), or it raised (`call` names the call in the message).
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
