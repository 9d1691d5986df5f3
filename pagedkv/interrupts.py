"""Ctrl-C at a safe point: hold SIGINT while the engine's books are half updated.

A KeyboardInterrupt from Ctrl-C (or Jupyter's "interrupt kernel") is raised between any two
Python bytecodes. The long part of a step, the model forward, may be interrupted anywhere: the
engine treats that step as never run. But the bookkeeping around it (the scheduler moving a
request from the running list to the waiting queue, the block pool taking a block off its free
queue and giving it to a request) must happen all or not at all, or a request or a block goes
missing. Those few microseconds run inside `deferred_interrupts()`:

    Ctrl-C ──► handler only notes it ──► block ends ──► old handler restored, signal re-sent

so the interrupt still arrives (as the same signal, to whatever handler was installed), just
after the state is whole again. Only the main thread receives signals in Python, so elsewhere
the block simply runs.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_holding = False
"""A `deferred_interrupts()` block is running in the main thread (blocks nest)."""


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block without a SIGINT arriving inside it; one that came is re-sent at its end."""
    global _holding
    # A handler not installed from Python (getsignal() is None) could not be put back: leave it.
    if _holding or threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    received: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    _holding = True
    try:
        yield
    finally:
        _holding = False
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)
