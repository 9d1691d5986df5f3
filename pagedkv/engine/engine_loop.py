"""The engine thread behind `AsyncLLM` (pagedkv/engine/async_llm.py): the only thread that calls
the LLM, and what it shares with the callers' event loops (in vLLM the engine core is another
process, vllm/v1/engine/core.py, and the hand-over goes through ZMQ sockets; here a condition
variable and `call_soon_threadsafe`).

    callers (any thread)                       engine thread
    submit / abort ──► inbox (under cond) ──►  applied between steps: add_request / abort_request
    RequestStream.queue ◄── one call_soon_threadsafe per event loop and step ◄── step() outputs
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field

from pagedkv.engine.llm import LLM, Prompt
from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams
from pagedkv.interrupts import deferred_interrupts
from pagedkv.worker.tp_executor import EngineDeadError

logger = logging.getLogger("pagedkv")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest step, for a /metrics endpoint: made by the engine
    thread, read from any thread (a new object each time, never changed)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    """Queued or preempted (n > 1: each child counts)."""
    kv_cache_usage: float = 0.0
    """Fraction of the KV cache blocks held by requests, 0..1."""
    prefix_cache_hit_rate: float = 0.0
    """Prompt tokens found in the prefix cache / tokens looked up, over the engine's life."""
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_requests_finished: int = 0
    """Requests that got their last output from the engine (stopped, at their length, or failed)."""
    num_requests_aborted: int = 0
    """Requests aborted (by `abort` or by a consumer that stopped reading) before they finished."""
    alive: bool = True
    """False once the engine loop has stopped (shut down or dead)."""


StreamItem = RequestOutput | BaseException | None
"""What a request's queue gets: outputs, then an exception (the engine loop stopped) or None
(aborted: the consumer makes the last output from what it has)."""


@dataclass(eq=False)
class RequestStream:
    """One generate() call's end of the hand-over: where the engine thread puts its outputs."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    engine_id: str | None = None
    """The LLM's id of the request, once the engine thread has added it."""


@dataclass(eq=False)
class _Add:
    stream: RequestStream
    prompt: Prompt
    params: SamplingParams


@dataclass(eq=False)
class _Abort:
    stream: RequestStream
    done: concurrent.futures.Future[bool] | None
    """Told whether the engine still had the request (for `await AsyncLLM.abort`)."""


def _put_all(items: list[tuple[RequestStream, StreamItem]]) -> None:
    """Runs on a consumer's event loop: one step's items for its requests."""
    for stream, item in items:
        stream.queue.put_nowait(item)


class EngineLoop:
    """The engine thread and what it shares with the callers; only its thread calls the LLM's
    add_request / abort_request / step. (Kept apart from AsyncLLM, so that a forgotten AsyncLLM is
    garbage-collected and its finalizer stops the thread.)"""

    def __init__(self, llm: LLM, owns_llm: bool) -> None:
        self.llm = llm
        self.owns_llm = owns_llm
        self.cond = threading.Condition()
        # Guarded by `cond`: shared with the callers' threads.
        self.inbox: list[_Add | _Abort] = []
        self.streams: dict[str, RequestStream] = {}
        """Request id -> stream of every request a caller may still abort (the ids in use)."""
        self.stopping = False
        self.dead: tuple[str, BaseException | None] | None = None
        """Why the loop stopped, and the exception that stopped it (None: shut down)."""
        # The engine thread's own.
        self.by_engine_id: dict[str, RequestStream] = {}
        self.outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = {}
        """Per event loop, what its streams get at the end of this iteration (one wake-up per loop)."""
        self.num_finished = 0
        self.num_aborted = 0
        self.snapshot = EngineSnapshot()
        self._publish()
        self.thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self.thread.start()

    # ---- the callers' side (any thread; each holds `cond` briefly) ----------------------

    def dead_error(self) -> EngineDeadError | None:
        """A fresh error for one caller (an exception object raised in two tasks would mix their tracebacks)."""
        if self.dead is None:
            return None
        message, cause = self.dead
        error = EngineDeadError(message)
        error.__cause__ = cause
        return error

    def submit(self, stream: RequestStream, prompt: Prompt, params: SamplingParams) -> None:
        with deferred_interrupts(), self.cond:  # in the books and the inbox, or in neither
            error = self.dead_error()
            if error is not None:
                raise error
            if stream.request_id in self.streams:
                raise ValueError(
                    f"request_id {stream.request_id!r} is in use by an unfinished request: pass another "
                    "(or None for a fresh one)."
                )
            self.streams[stream.request_id] = stream
            self.inbox.append(_Add(stream, prompt, params))
            self.cond.notify()

    def abort(self, request_id: str | RequestStream, done: concurrent.futures.Future[bool] | None) -> bool:
        """Queue an abort (of the stream now registered under `request_id`, or of this stream);
        False if there is nothing to abort. Never waits for the engine."""
        with deferred_interrupts(), self.cond:
            if isinstance(request_id, RequestStream):
                # Not registered: it ended in the engine, or an abort of it is queued already.
                registered = self.streams.get(request_id.request_id) is request_id
                stream = self.streams.pop(request_id.request_id) if registered else None
            else:
                stream = self.streams.pop(request_id, None)
            if stream is None or self.dead is not None:
                return False
            self.inbox.append(_Abort(stream, done))
            self.cond.notify()
            return True

    def stop(self) -> None:
        """Stop the loop after its current step and wait for it; the requests in flight get an
        EngineDeadError. Calling it again does nothing."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        if self.owns_llm:
            self.llm.shutdown()

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                busy = llm.has_unfinished_requests()
                with self.cond:
                    while not (self.inbox or self.stopping or busy):
                        self.cond.wait()  # idle: asleep until a request, an abort or stop() comes
                    if self.stopping:
                        break
                    inbox, self.inbox = self.inbox, []
                for item in inbox:
                    if isinstance(item, _Add):
                        self._add(item)
                    else:
                        self._abort(item)
                if llm.has_unfinished_requests():
                    self._dispatch(llm.step())
                self._publish()  # before the outputs go: a consumer who sees one sees stats as new
                self._send()
        except BaseException as error:  # the thread ends here: its callers must hear why
            # As vLLM's engine core, which shuts down when a step raises: a failure of one request
            # never gets here (LLM.step finishes that request with finish_reason "error").
            logger.exception("The pagedkv engine loop stopped.")
            self._close(
                f"The engine loop stopped on {type(error).__name__}: {error}. Its requests were aborted; "
                "create a new AsyncLLM.",
                error,
            )
            return
        self._close("This AsyncLLM was shut down (its requests in flight were aborted); create a new one.", None)

    def _add(self, item: _Add) -> None:
        stream = item.stream
        try:
            stream.engine_id = self.llm.add_request(item.prompt, item.params)
        except Exception as error:  # this request alone fails; the loop goes on
            logger.warning("Request %s could not be added: %r", stream.request_id, error)
            self._forget([stream])
            failed = RequestOutput(
                stream.request_id,
                stream.prompt,
                stream.prompt_token_ids,
                [CompletionOutput(i, "", [], "error") for i in range(stream.n)],
                finished=True,
                error=f"{type(error).__name__}: {error}",
            )
            self.num_finished += 1
            self._post(stream, failed)
            return
        self.by_engine_id[stream.engine_id] = stream

    def _abort(self, item: _Abort) -> None:
        stream = item.stream
        aborted = stream.engine_id is not None and self.by_engine_id.pop(stream.engine_id, None) is stream
        if aborted:
            assert stream.engine_id is not None
            aborted = self.llm.abort_request(stream.engine_id)
        if aborted:
            self.num_aborted += 1
            self._post(stream, None)
        if item.done is not None:
            item.done.set_result(aborted)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, under the callers' request ids."""
        finished = []
        for output in outputs:
            stream = self.by_engine_id.get(output.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if output.finished:
                del self.by_engine_id[output.request_id]
                finished.append(stream)
            output.request_id = stream.request_id  # the LLM made this output for us alone (no copy: hot path)
            self._post(stream, output)
        self.num_finished += len(finished)
        self._forget(finished)

    def _post(self, stream: RequestStream, item: StreamItem) -> None:
        self.outbox.setdefault(stream.loop, []).append((stream, item))

    def _send(self) -> None:
        """Hand the outbox over: one call_soon_threadsafe per event loop."""
        outbox, self.outbox = self.outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed: no one will read these requests
                for stream, _ in items:
                    if stream.engine_id is not None and self.by_engine_id.pop(stream.engine_id, None) is stream:
                        self.llm.abort_request(stream.engine_id)
                        self.num_aborted += 1
                self._forget([stream for stream, _ in items])

    def _forget(self, streams: list[RequestStream]) -> None:
        """Free the request ids of streams that ended (a caller may use them again)."""
        if streams:
            with self.cond:
                for stream in streams:
                    if self.streams.get(stream.request_id) is stream:
                        del self.streams[stream.request_id]

    def _close(self, message: str, cause: BaseException | None) -> None:
        """The loop has stopped: every request in flight or queued ends with an EngineDeadError,
        its blocks freed in the LLM (which stays usable if only this loop is gone)."""
        with self.cond:
            self.dead = (message, cause)
            pending = {id(s): s for s in [*self.streams.values(), *self.by_engine_id.values()]}
            for item in self.inbox:
                pending[id(item.stream)] = item.stream
                if isinstance(item, _Abort) and item.done is not None:
                    item.done.set_result(False)
            self.inbox, self.streams = [], {}
        for stream in self.by_engine_id.values():
            try:
                self.llm.abort_request(stream.engine_id or "")
            except Exception:  # a broken LLM: the requests still hear why, below
                logger.exception("Request %s could not be aborted after the engine loop stopped.", stream.request_id)
        self.by_engine_id = {}
        for stream in pending.values():
            self._post(stream, self.dead_error())
        self._publish()
        self._send()

    def _publish(self) -> None:
        llm = self.llm
        stats = llm.stats
        self.snapshot = EngineSnapshot(
            num_requests_running=len(llm.scheduler.running),
            num_requests_waiting=len(llm.scheduler.waiting),
            kv_cache_usage=llm.kv_cache_manager.usage(),
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            num_prefix_cache_queries=stats.num_lookup_tokens,
            num_prefix_cache_hits=stats.num_cached_tokens,
            num_steps=stats.num_steps,
            num_preemptions=stats.num_preemptions,
            num_prefill_tokens=stats.num_prefill_tokens,
            num_decode_tokens=stats.num_decode_tokens,
            num_requests_finished=self.num_finished,
            num_requests_aborted=self.num_aborted,
            alive=self.dead is None,
        )
