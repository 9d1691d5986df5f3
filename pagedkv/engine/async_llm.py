"""`AsyncLLM`: the engine a server drives -- requests come and go while it runs (in vLLM:
vllm/v1/engine/async_llm.py, whose engine core runs in another process; here it is a thread).

    async with AsyncLLM(model="tiny") as engine:
        async for output in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
            print(output.outputs[0].text, output.finished)   # cumulative; the last one is finished

    caller's event loop(s)                        engine thread (pagedkv/engine/engine_loop.py)
    generate(): check, register ──── inbox ────►  between steps: add_request / abort_request
    async for ◄── request's asyncio.Queue ◄────  step() -> RequestOutputs; asleep when idle

A consumer that stops reading (break, aclose, a cancelled task) aborts its request, and its KV
cache blocks are freed. An exception from a step stops the loop: every pending request raises
`EngineDeadError` naming the cause, and so does every later `generate`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.engine_loop import EngineLoop, EngineSnapshot, RequestStream
from pagedkv.engine.llm import LLM, Prompt
from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams
from pagedkv.models.tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineSnapshot", "fold_output"]


def fold_output(merged: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """A request's state so far: `new`, holding the latest CompletionOutput of every index seen.

    A request with SamplingParams(n > 1) streams one RequestOutput per child and step, each with
    only that child's CompletionOutput; fold them with `merged = fold_output(merged, output)`
    (as vLLM's RequestOutput.add does) to get all n, ordered by index."""
    if merged is None:
        return replace(new, outputs=sorted(new.outputs, key=lambda c: c.index))
    latest = {c.index: c for c in merged.outputs}
    latest.update((c.index, c) for c in new.outputs)
    return replace(
        new,
        outputs=[latest[i] for i in sorted(latest)],
        error=new.error if new.error is not None else merged.error,  # a failed child's reason stays
        prompt_logprobs=new.prompt_logprobs if new.prompt_logprobs is not None else merged.prompt_logprobs,
    )


class AsyncLLM:
    """An `LLM` run by its own thread, streaming each request's outputs to an `async for`.

    Arguments: those of `LLM` (pagedkv.engine.arg_utils.EngineArgs); or wrap an existing, idle
    LLM with `AsyncLLM.from_llm(llm)` (which leaves it idle and usable again after `shutdown`).
    From then on only the engine thread may call the LLM.
    """

    def __init__(self, model: str = EngineArgs.model, **engine_args: Any) -> None:
        self._start(LLM(model, **engine_args), owns_llm=True)

    @classmethod
    def from_llm(cls, llm: LLM) -> AsyncLLM:
        """Serve an existing LLM; it must be idle (no request added with add_request unfinished)."""
        if not isinstance(llm, LLM):
            raise TypeError(f"AsyncLLM.from_llm takes an LLM, got {llm!r}.")
        if llm.has_unfinished_requests():
            raise ValueError(
                "AsyncLLM.from_llm needs an idle LLM, but it has unfinished requests: step() them to the end "
                "or abort_request() them first."
            )
        engine = cls.__new__(cls)
        engine._start(llm, owns_llm=False)
        return engine

    def _start(self, llm: LLM, owns_llm: bool) -> None:
        self.llm = llm
        """The engine (read its configuration; do not call it while this AsyncLLM runs)."""
        self._loop = EngineLoop(llm, owns_llm)
        # Stops the thread when this object is garbage-collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self._loop.stop)

    @property
    def stats(self) -> EngineSnapshot:
        """The engine's state after its latest step; safe to read from any thread."""
        return self._loop.snapshot

    @property
    def is_running(self) -> bool:
        """False once shut down, or once a step exception stopped the engine loop."""
        return self._loop.dead is None

    def get_tokenizer(self) -> Tokenizer:
        """The LLM's tokenizer (safe from any thread: encoding and decoding change nothing in it)."""
        return self.llm.get_tokenizer()

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs as its tokens come (cumulative; the last one has
        finished=True); a consumer that falls behind gets the steps it missed in one output. With
        n > 1, each holds the children that got tokens: fold them with `fold_output`.

        Bad input raises the first time the generator is awaited (TypeError / ValueError, as
        LLM.add_request's), before anything is queued; so does a request_id in use (ValueError).
        Stopping early (break, aclose(), cancelling the task) aborts the request and frees its
        KV cache blocks. If the engine loop stops, raises EngineDeadError naming why."""
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None (a fresh id), got {request_id!r}.")
        error = self._loop.dead_error()
        if error is not None:
            raise error
        params = SamplingParams() if sampling_params is None else sampling_params
        # The LLM's own checks, here in the caller's thread (they read only the tokenizer and the
        # configuration): bad input raises now, not later as a failed request.
        token_ids, text, params = self.llm._prepare(prompt, params)
        stream = RequestStream(request_id, asyncio.get_running_loop(), text, token_ids, params.n)
        merged: RequestOutput | None = None
        finished = False
        try:
            self._loop.submit(stream, prompt, params)
            while not finished:
                items = [await stream.queue.get()]
                # A consumer that fell behind gets everything that came meanwhile as one output (they
                # are cumulative), as vLLM's RequestOutputCollector does: a slow client costs neither a
                # growing queue nor a yield per step it missed.
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                batch: RequestOutput | None = None
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True  # the engine is gone: nothing to abort
                        raise item
                    output = self._aborted(stream, merged) if item is None else item
                    # With n = 1 an output holds the whole request so far.
                    merged = output if stream.n == 1 else fold_output(merged, output)
                    batch = output if stream.n == 1 else fold_output(batch, output)
                assert batch is not None
                finished = batch.finished
                yield batch
        finally:
            if not finished:  # the consumer stopped reading: free the request's blocks
                self._loop.abort(stream, None)

    @staticmethod
    def _aborted(stream: RequestStream, merged: RequestOutput | None) -> RequestOutput:
        """The last output of an aborted request: what it had, every unfinished child "abort"."""
        completions = {c.index: c for c in merged.outputs} if merged is not None else {}
        outputs = [
            completions.get(i, CompletionOutput(i, "", [], None)) for i in sorted({*range(stream.n), *completions})
        ]
        return RequestOutput(
            stream.request_id,
            stream.prompt,
            stream.prompt_token_ids,
            [c if c.finish_reason is not None else replace(c, finish_reason="abort") for c in outputs],
            finished=True,
            prompt_logprobs=merged.prompt_logprobs if merged is not None else None,
        )

    async def abort(self, request_id: str) -> bool:
        """Abort a request: its generator yields a last output (finish_reason "abort") and ends.
        Returns once the engine has applied it: True if the request was unfinished there."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str (the one given to generate), got {request_id!r}.")
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        if not self._loop.abort(request_id, done):
            return False
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Stop the engine thread (after its current step) and wait for it; requests in flight
        raise EngineDeadError. An LLM this object made is shut down too. Calling it twice is fine."""
        self._finalizer()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()
