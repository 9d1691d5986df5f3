"""Watching a student's code while a checker runs it: which of the package's functions it called.

A checker calls the student's answer inside `watch_calls(functions)`; a call to one of the
package's own implementations (by any name, through a wrapper, from a copy of its code, on any
thread) or to a builtin that reads the checker's frames is noted, and the checker turns the answer
away. Two nets, because each alone has a hole:

    profiler  every thread (this one, those started in the block, those started before it),
              matching code objects by content: sees copies, but only calls of Python code
    tripwire  each watched function's code swapped for one that raises PackageCalled: stops a
              call outright, on any thread, but only of the original function object
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

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
    up the stack. Two nets: a profiler on every thread (this one, those started in the block, and
    those started before it: a thread pool made earlier), which matches code by content, so a copy
    of a function (`types.FunctionType(f.__code__, ...)`, `code.replace(...)`) is noticed as the
    function itself; and tripwires (`_tripwires`) that make a call of an original raise
    PackageCalled instead of running. A profiler already set (cProfile) is paused in the block; on
    Python 3.11 a profiler another thread had set is not restored after it (there is no API to read it).
    """
    functions = list(functions)
    by_content = {_content(f.__code__): f.__qualname__ for f in functions if hasattr(f, "__code__")}
    seen: dict[int, tuple[CodeType, str | None]] = {}  # id(code) -> (code, its name if watched): one look each
    called: list[str] = []

    def note(name: str) -> None:
        if name not in called:
            called.append(name)

    def watched(code: CodeType) -> str | None:
        known = seen.get(id(code))
        if known is None or known[0] is not code:
            known = seen[id(code)] = (code, by_content.get(_content(code)))
        return known[1]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and (name := watched(frame.f_code)) is not None:
            note(name)
        elif event == "c_call" and arg in FRAME_READERS:
            note(f"{arg.__module__}.{arg.__name__} (reading the checker's frames)")

    def profile_earlier_threads(frame: FrameType, event: str, arg: object) -> None:
        """On threads started before the block: package calls only (their frame readers may be a
        kernel's logging, and the expected answer does not exist yet while the answer runs)."""
        if event == "call" and (name := watched(frame.f_code)) is not None:
            note(name)

    set_all = getattr(threading, "setprofile_all_threads", None)  # Python 3.12+
    previous, previous_threads = sys.getprofile(), threading.getprofile()
    with _tripwires(functions, note):
        try:  # set inside the try: an interrupt between the calls still restores them all
            if set_all is not None:
                set_all(profile)
            else:
                threading.setprofile(profile)
                _set_profile_on_other_threads(profile_earlier_threads)
            sys.setprofile(profile)
            yield called
        finally:
            sys.setprofile(previous)
            if set_all is not None:
                set_all(None)
            else:
                _set_profile_on_other_threads(None)
            threading.setprofile(previous_threads)


def _content(code: CodeType) -> tuple[object, ...]:
    """What a code object computes (bytecode, constants, names), whatever it is called: a copy of
    a watched function's code, renamed or not, matches the original."""
    return (code.co_code, code.co_consts, code.co_names)


_PROFILE_FUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
"""C's Py_tracefunc: (the object passed along, the frame, the event (0: a call), its argument)."""
_installed: list[Any] = []  # the C callback while set: ctypes must keep it alive


def _set_profile_on_other_threads(profile: Callable[[FrameType, str, object], None] | None) -> None:
    """Set (or, with None, clear) a profiler on every thread but this one that runs Python now.

    Python 3.11 has no `threading.setprofile_all_threads` (3.12 does, looping over the thread
    states with `_PyEval_SetProfile`, which CPython 3.11 exports too): this is that loop, through
    ctypes, with the profiler as a C callback that hands each call's frame to `profile`. Where the
    interpreter does not export it (not CPython), the tripwires alone watch those threads.
    """
    api = ctypes.pythonapi
    if not hasattr(api, "_PyEval_SetProfile"):
        return
    api._PyEval_SetProfile.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.py_object]
    api.PyThreadState_Get.restype = api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    api.PyInterpreterState_ThreadHead.restype = api.PyThreadState_Next.restype = ctypes.c_void_p
    callback = None
    if profile is not None:

        def on_event(_: object, frame: int, what: int, arg: int) -> int:
            if what == 0:  # PyTrace_CALL: a Python function starts
                profile(ctypes.cast(frame, ctypes.py_object).value, "call", None)
            return 0

        callback = _PROFILE_FUNC(on_event)
    _installed[:] = [callback] if callback is not None else []
    this = api.PyThreadState_Get()
    state = api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while state:
        if state != this:
            api._PyEval_SetProfile(state, ctypes.cast(callback, ctypes.c_void_p) if callback else None, None)
        state = api.PyThreadState_Next(state)


def functions_of(module: ModuleType, *, but: Iterable[Callable[..., Any]] = ()) -> list[Callable[..., Any]]:
    """Every function `module` defines, with its classes' methods and property getters, and what a
    decorator (`functools.lru_cache`) wraps: a watch of them leaves no sibling out (another spec
    class's page size next to the one watched). `but`: functions the notebook hands out."""
    found: list[Callable[..., Any]] = []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported from elsewhere
        # A class's own methods, not the dunders a dataclass generates (they compute no answer).
        members = [m for n, m in vars(obj).items() if not n.startswith("__")] if isinstance(obj, type) else [obj]
        for member in members:
            if isinstance(member, property):
                member = member.fget
            elif isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            while callable(member):
                if isinstance(member, FunctionType) and member not in found:
                    found.append(member)
                member = getattr(member, "__wrapped__", None)
    excluded = list(but)
    return [f for f in found if not any(f is e or f is getattr(e, "__wrapped__", None) for e in excluded)]
