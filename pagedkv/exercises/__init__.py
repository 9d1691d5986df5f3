"""Workbook exercises: each notebook's exercise calls a checker here.

How a checker works, and what it promises a student:

- It runs the student's function on cases it makes up (configurations, traces, tensors), including
  ones no helper of the package accepts, or reads the answer off a live engine. The expected answer
  is computed inside the checker, after the student's code has run: it is stored nowhere a student
  could import or read it from (not in a module, not in a frame the student's code can reach).
- An answer that hands the work back to the package (its function itself, or a call to it on any
  thread) is turned away, and so is code that reads the checker's frames.
- It compares only plain values it rebuilds itself from the answer (`plain`): an answer's own
  `__eq__`, `__iter__` or `__index__` takes no part, so an object that says it equals anything
  does not pass.
- A wrong answer is told which rule or invariant it broke, with a hint, never the expected value.
  After three wrong tries of one exercise, `reveal()` shows the answer of the case that failed,
  worked out step by step. The tries and the worked answers are kept out of reach of the
  student's code (`_install_store` says how far that goes).
- An answer left as `...` is not graded and costs no try: the result says "not answered yet".

    @exercise("02: the next step's slot mapping")
    def check_next_slot_mapping(llm, answer) -> CheckResult: ...
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import CodeType, FrameType
from typing import Any, ParamSpec, TypeVar, overload

import numpy as np
import torch

from pagedkv.exercises.watch import watch_calls

P = ParamSpec("P")
T = TypeVar("T")
PASS_MARK, FAIL_MARK, TODO_MARK = "✓", "✗", "○"
"""Text symbols (U+2713, U+2717, U+25CB), found in common text fonts: no emoji font needed to show them."""
REVEAL_AFTER = 3
"""Wrong tries of one exercise after which `reveal()` shows the worked answer."""


@dataclass
class CheckResult:
    """Outcome of one exercise check; renders as one line in a notebook.

    A failing result may be built with `reveal`: a function that works out the answer of the case
    that failed. The result does not keep it (its `reveal` reads None once built): the function goes
    to the hidden store of tries (`_install_store`), which calls it only from `reveal()`, after
    `REVEAL_AFTER` wrong tries. `answered` is False for an exercise not attempted yet: neither a
    pass nor a fail, and no try is counted.
    """

    ok: bool
    message: str
    reveal: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    answered: bool = True

    def __post_init__(self) -> None:
        if self.reveal is not None:
            sys.audit(_WORK)  # the store takes `self.reveal` from this frame, if a counted check is running
            self.reveal = None

    def __repr__(self) -> str:
        return f"{TODO_MARK if not self.answered else PASS_MARK if self.ok else FAIL_MARK} {self.message}"

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Either:
    """`plain`'s template for an answer that may take one of several forms (a tuple, or None)."""

    forms: tuple[object, ...]


_NUMPY_SCALARS = frozenset(np.dtype(code).type for code in np.typecodes["AllInteger"] + np.typecodes["Float"])
"""numpy's own scalar types (not subclasses): `plain` takes their value with numpy's `item`."""


def _describe(like: object) -> str:
    """What `plain(value, like)` wants, in words: "an int", "a list of ints", "a tuple (int, str)"."""
    if isinstance(like, Either):
        return " or ".join(_describe(form) for form in like.forms)
    if isinstance(like, Enum):
        return f"a {type(like).__name__}"
    if isinstance(like, torch.Tensor):
        return "a torch.Tensor"
    if isinstance(like, (list, set, frozenset)):
        kind = "list" if isinstance(like, list) else "set"
        inner = _describe(next(iter(like))) if like else "an int"
        return f"a {kind} of {inner.split(' ', 1)[-1]}s"
    if isinstance(like, tuple):
        return f"a tuple ({', '.join(_describe(x).split(' ', 1)[-1] for x in like)})"
    if isinstance(like, dict):
        key, value = next(iter(like.items()), (0, 0))
        return f"a dict of {_describe(key).split(' ', 1)[-1]} to {_describe(value).split(' ', 1)[-1]}"
    if like is Ellipsis:
        return "a value"
    return {bool: "a bool", int: "an int", float: "a float", str: "a str", type(None): "None"}[type(like)]


@overload
def plain(value: object, like: Either) -> Any: ...  # one of the forms: the caller looks at which


@overload
def plain(value: object, like: T) -> T: ...


def plain(value: object, like: Any) -> Any:
    """`value` rebuilt from builtin types in the shape of `like` (a value the checker built itself).

    The checkers compare only what this returns, so no method of the student's object takes part in
    the comparison: an `__eq__` that always says yes, an `__iter__` or `__len__` that tells one
    thing to a first look and another to the second, an `__index__` asked twice. Containers are
    read through the builtin types' own methods (`list.__getitem__`, not the object's), numbers
    through `int.__index__` / `float.__float__` (exact copies even of a subclass), numpy scalars,
    arrays and tensors only of exactly numpy's and torch's types (a subclass could change what
    their methods return). No code of the answer runs here, so `plain` may run outside the watch
    of `watch_calls`. A list, tuple, range, 1-d array or 1-d tensor of the right values passes where a
    list or tuple is expected; a tuple must have `like`'s length; `Either` takes one of several
    forms; `...` in a template takes any value as it is (the checker reads it further itself).
    Raises TypeError naming the type wanted when `value` is not of that form.
    """
    name = type(value).__name__
    wanted = TypeError(f"the answer should be {_describe(like)}, not {'an' if name[0] in 'aeiou' else 'a'} {name}")
    if like is Ellipsis:
        return value  # any value: the checker reads it further itself
    if isinstance(like, Either):
        for form in like.forms:
            try:
                return plain(value, form)
            except TypeError:
                continue
        raise wanted
    if isinstance(like, bool) or isinstance(like, Enum) or like is None:
        if type(value) is not type(like):
            raise wanted
        return value  # bool, Enum and None: no subclass, equality by identity
    if isinstance(like, (int, float)):
        if type(value) is torch.Tensor and value.numel() == 1:
            value = torch.Tensor.item(value)
        if isinstance(value, bool):
            raise wanted
        if isinstance(value, int):
            number: int | float = int.__index__(value)
        elif type(value) in _NUMPY_SCALARS:
            number = value.item()  # type: ignore[attr-defined]  # numpy's own scalar types: numpy's code
        elif isinstance(value, float):
            number = float.__float__(value)
        else:
            raise wanted
        if isinstance(like, int) and type(number) is not int:
            raise wanted
        return number if isinstance(like, int) else float(number)
    if isinstance(like, str):
        if not isinstance(value, str):
            raise wanted
        return str.__str__(value)
    if isinstance(like, torch.Tensor):
        if type(value) is not torch.Tensor:
            raise wanted
        return value
    if isinstance(like, dict):
        if not isinstance(value, dict):
            raise wanted
        key, item = next(iter(like.items()), (0, 0))
        return {plain(k, key): plain(v, item) for k, v in list(dict.items(value))}
    if isinstance(like, (list, tuple, set, frozenset)):
        entries = _entries(value, wanted)
        if isinstance(like, tuple):
            if len(entries) != len(like):
                raise TypeError(f"the answer should be {_describe(like)}: {len(like)} values, not {len(entries)}")
            return tuple(plain(v, x) for v, x in zip(entries, like))
        each = next(iter(like), 0)
        rebuilt = [plain(v, each) for v in entries]
        return rebuilt if isinstance(like, list) else frozenset(rebuilt)
    raise TypeError(f"plain() cannot rebuild {type(like).__name__}")


def _entries(value: object, wanted: TypeError) -> list[object]:
    """The entries of a list, tuple, set, range, 1-d array or tensor, read through the builtin types' methods."""
    if type(value) in (torch.Tensor, np.ndarray) and value.ndim == 1:  # type: ignore[attr-defined]
        return list(value.tolist())  # type: ignore[attr-defined]  # exactly their types: their own code
    if type(value) is range:
        return list(value)
    if isinstance(value, list):
        return [list.__getitem__(value, i) for i in range(list.__len__(value))]
    if isinstance(value, tuple):
        return [tuple.__getitem__(value, i) for i in range(tuple.__len__(value))]
    if isinstance(value, set):
        return list(set.__iter__(value))
    if isinstance(value, frozenset):
        return list(frozenset.__iter__(value))
    raise wanted


def not_plain(what: str, error: TypeError) -> CheckResult:
    """The rejection of an answer `plain` could not rebuild (no worked answer: it is about the form)."""
    return CheckResult(False, f"{what}: {error}.")


def compare(what: str, got: object, expected: object, hint: str = "") -> CheckResult:
    """Equal -> ok; else which entry (for lists) is off, the hint, and the expected value only in `reveal`.

    `got` is first rebuilt by `plain` in the shape of `expected`: only plain values are compared."""
    try:
        got = plain(got, expected)
    except TypeError as error:
        return not_plain(what, error)
    if got == expected:
        return CheckResult(True, f"{what}: correct.")
    detail = f"{got!r} is not it"
    if isinstance(got, list) and isinstance(expected, list):
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


_WORK, _TRIED, _ASK, _REGISTER, _FORGET = (
    f"pagedkv.exercises.{event}" for event in ("work", "tried", "ask", "register", "forget")
)
"""The audit events between the checkers and the hidden store of tries (`_install_store`)."""


def exercise(title: str) -> Callable[[Callable[P, CheckResult]], Callable[P, CheckResult]]:
    """Make a checker count wrong tries: after `REVEAL_AFTER` of them its message offers `reveal()`.

    An argument left as `...` (the notebook's placeholder) is not a try: the checker does not run,
    and the result says the exercise is not answered yet."""

    def decorate(check: Callable[P, CheckResult]) -> Callable[P, CheckResult]:
        sys.audit(_REGISTER)  # the store notes that `check` is the checker of `title`

        @functools.wraps(check)
        def counted(*args: P.args, **kwargs: P.kwargs) -> CheckResult:
            if any(arg is Ellipsis for arg in (*args, *kwargs.values())):
                return CheckResult(
                    False,
                    f"{title}: not answered yet. Replace the `...` with your answer and run the cell "
                    "again (no try is counted).",
                    answered=False,
                )
            result = check(*args, **kwargs)
            tries: list[int] = []
            sys.audit(_TRIED)  # the store reads title, check, result from this frame, appends to `tries`
            if not result.ok and result.answered and tries and tries[0] >= REVEAL_AFTER:
                result.message += f" (Try {tries[0]}. Stuck? `reveal()` works out this case for you.)"
            return result

        return counted

    return decorate


def reveal() -> None:
    """Print the worked answer of the case the last failing check tried, once it failed three times."""
    text: list[str] = []
    sys.audit(_ASK, text)
    print(text[0])


def forget_tries() -> None:
    """Forget every wrong try and the last failure (a test starts from none; a student gains nothing)."""
    sys.audit(_FORGET)


def _install_store() -> None:
    """Keep the tries and the worked answers in the closure of an audit hook (`sys.addaudithook`).

    Why there: a student's code runs in this process, and whatever a module, a checker or `reveal`
    holds can be walked to (`vars(module)`, `__globals__`, `__closure__`, `__wrapped__`). The
    interpreter keeps audit hooks in its own state, which Python cannot list; the checkers talk to
    the hook through `sys.audit` events, and the hook takes what it needs from the frame that raised
    the event, after checking that frame runs this module's own code (`counted`, `decorate`,
    `CheckResult.__post_init__`) with the checker registered under that title. So an event raised
    by hand, or by a copy of that code around another checker, counts nothing; a try is counted
    only when a registered checker ran and failed. The store keeps titles by hash and functions by
    id, so `gc.get_referrers` from a checker, a result or a title finds nothing either.

    What it does not stop, in one Python process: `gc.get_objects()` lists every object (the stored
    worked answers among them), a profile, trace or audit hook the student installs sees the
    checkers' frames, and ctypes can read any memory. Grading that must hold against those runs the
    checker in a process of its own (`pagedkv lab check`).
    """
    decorate_code = next(c for c in exercise.__code__.co_consts if isinstance(c, CodeType))
    counted_code = next(c for c in decorate_code.co_consts if isinstance(c, CodeType) and c.co_name == "counted")
    post_init_id, counted_id, decorate_id = map(id, (CheckResult.__post_init__.__code__, counted_code, decorate_code))
    checkers: dict[int, int] = {}  # hash(title) -> id(check)
    wrong: dict[int, int] = {}  # hash(title) -> wrong tries in a row
    pending: dict[int, list[tuple[weakref.ref[CheckResult], Callable[[], str]]]] = {}  # id(counted frame) -> works
    last: list[tuple[bytes, Callable[[], str] | None]] = []  # the latest failure: its title and worked answer

    def genuine(frame: FrameType | None, code_id: int) -> dict[str, Any] | None:
        """The locals of `frame` if it runs the code `code_id` for a registered checker, else None."""
        if frame is None or id(frame.f_code) != code_id:
            return None
        local = frame.f_locals
        registered = checkers.get(hash(local["title"]))
        return local if code_id == decorate_id or registered == id(local["check"]) else None

    def work_text() -> str:
        if not last:
            return "Nothing to reveal: no check has failed yet in this kernel."
        title, work = last[0][0].decode(), last[0][1]
        if work is None:
            return f"{title}: this failure has nothing to work out (it is about the form of the answer)."
        tries = wrong.get(hash(title), 0)
        if tries < REVEAL_AFTER:
            return (
                f"{title}: {tries} wrong tr{'y' if tries == 1 else 'ies'} so far; "
                f"reveal() works out the answer after {REVEAL_AFTER}. Reread the hint and try again."
            )
        return f"{title}, worked out:\n{work()}"

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not event.startswith("pagedkv.exercises."):
            return
        caller = sys._getframe(1)
        if event == _WORK and id(caller.f_code) == post_init_id:
            result = caller.f_locals["self"]
            frame: FrameType | None = caller
            while frame is not None and genuine(frame, counted_id) is None:
                frame = frame.f_back
            if frame is not None:  # made while a counted check runs; else a result made by hand
                pending.setdefault(id(frame), []).append((weakref.ref(result), result.reveal))
        elif event == _TRIED and (local := genuine(caller, counted_id)) is not None:
            result, key = local["result"], hash(local["title"])
            works = pending.pop(id(caller), [])
            if type(result) is not CheckResult or not result.answered:
                return
            if result.ok:
                wrong.pop(key, None)
                return
            wrong[key] = wrong.get(key, 0) + 1
            # The title as bytes: a tuple holding the title's str would be found by gc.get_referrers(title).
            last[:] = [(local["title"].encode(), next((w for ref, w in works if ref() is result), None))]
            local["tries"].append(wrong[key])
        elif event == _REGISTER and (local := genuine(caller, decorate_id)) is not None:
            checkers[hash(local["title"])] = id(local["check"])
            wrong.pop(hash(local["title"]), None)  # a checker defined again starts from no tries
        elif event == _ASK and args and type(args[0]) is list:
            args[0].append(work_text())
        elif event == _FORGET:
            wrong.clear()
            last.clear()

    sys.addaudithook(hook)


_install_store()


def package_answer(answer: object, functions: Iterable[Callable[..., Any]], what: str) -> CheckResult | None:
    """A rejection if `answer` is not a function (its result was passed instead) or is one of the
    package's `functions` itself, else None."""
    if not callable(answer):
        return CheckResult(False, f"Pass your function itself (not its result), got {answer!r}.")
    try:
        unwrapped = inspect.unwrap(answer)  # what a cache or a wraps() wraps
    except ValueError:  # a __wrapped__ chain that loops
        unwrapped = answer
    for function in functions:
        if any(function is given for given in (answer, unwrapped)):  # identity only: no __eq__ of the answer runs
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
