"""What /v1/completions and /v1/chat/completions share (as vllm/entrypoints/openai/serving_engine.py):
the model-name check, prompts turned into token ids, several engine streams merged into one, the
server-sent-events framing and the conversion of log-probabilities."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams
from pagedkv.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from pagedkv.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, RequestError, SamplingRequest
from pagedkv.worker.tp_executor import EngineDeadError

if TYPE_CHECKING:
    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request the engine failed on (not the request's fault): a 500 with the engine's message."""


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event, as OpenAI streams them: `data: {json}` and a blank line."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""


def error_json(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body; `type` is what the client's exception classes key on."""
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()


def failure_message(error: Exception) -> str:
    """What a client is told about a failure, logged here (with its traceback where it is a surprise)."""
    if isinstance(error, (EngineError, EngineDeadError)):  # the message says it all
        logger.error("A request failed: %s", error)
        return str(error)
    logger.error("A request failed: %s", error, exc_info=error)
    return f"The server failed: {type(error).__name__}: {error}"


Outputs = AsyncGenerator[tuple[int, RequestOutput], None]
"""(prompt index, output) of a request's engine streams, merged."""


async def merge_streams(streams: Sequence[AsyncIterator[RequestOutput]]) -> Outputs:
    """(i, output) from every stream, as they come (a batch of prompts runs side by side).

    Closing the merged stream (a client that went away) closes every input stream, which aborts its
    engine request: nothing keeps running for a reader that is gone.
    """
    if len(streams) == 1:  # the common case, without tasks
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def drain(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait((i, error))
        finally:
            await _aclose(stream)

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def chain(first: tuple[int, RequestOutput], rest: Outputs) -> Outputs:
    """`first`, then `rest` (which the caller closes)."""
    yield first
    async for item in rest:
        yield item


async def _aclose(stream: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class OpenAIServing:
    """The engine, the name it is served under, and the steps every generating endpoint takes."""

    def __init__(self, engine: AsyncLLM, model_name: str, max_model_len: int, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.tokenizer: Tokenizer = engine.get_tokenizer()

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (OpenAI's `model_not_found`)."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model {model!r} does not exist: this server serves {self.model_name!r} (GET /v1/models).",
                "model",
                status=404,
                code="model_not_found",
            )

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text encoded with the engine's tokenizer, ids as given (the engine
        checks them against the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty.", "prompt")
            try:
                return self.tokenizer.encode(prompt)
            except UnicodeError as error:  # a lone surrogate ("\ud800" in the JSON): not UTF-8 text
                raise RequestError(f"The prompt cannot be encoded as UTF-8: {error}.", "prompt") from None
        if not prompt:
            raise RequestError("prompt is an empty list of token ids.", "prompt")
        return list(prompt)

    async def start(
        self,
        request: SamplingRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        tracker: RequestTracker,
    ) -> tuple[Outputs, tuple[int, RequestOutput]]:
        """Start one engine request per prompt; returns the merged stream and its first output.

        Waiting for the first output lets a prompt or parameters the engine refuses become a 400
        before any response is sent (a streamed response cannot change its status once begun).
        """
        streams = [
            self.engine.generate({"prompt_token_ids": ids}, params, f"{request_id}-{i}")
            for i, ids in enumerate(prompts)
        ]
        merged = merge_streams(streams)
        try:
            first = await anext(merged)
        except StopAsyncIteration:
            raise EngineError("The engine ended the request without an output.") from None
        except (TypeError, ValueError) as error:
            await merged.aclose()
            raise RequestError(str(error), request.param_of(str(error)) or "prompt") from None
        except BaseException:
            await merged.aclose()
            raise
        tracker.start(sum(map(len, prompts)))
        return merged, first

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top_logprobs(self, logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
        """The k most likely of a position's returned tokens (the dict also holds the sampled one)."""
        return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:k]


class Deltas:
    """What each choice gained since its last chunk: the engine's outputs are cumulative, a stream's
    chunks hold only the new text and tokens."""

    def __init__(self) -> None:
        self.sent_text: dict[int, int] = {}  # choice -> characters of its text sent
        self.sent_tokens: dict[int, int] = {}  # choice -> its tokens sent

    def started(self, index: int) -> bool:
        return index in self.sent_text

    def take(self, index: int, completion: CompletionOutput) -> tuple[str, int] | None:
        """(new text, index of its first new token), marked as sent; None when there is nothing new."""
        text = completion.text[self.sent_text.get(index, 0) :]
        start = self.sent_tokens.get(index, 0)
        if not text and start == len(completion.token_ids) and completion.finish_reason is None:
            return None
        self.sent_text[index] = len(completion.text)
        self.sent_tokens[index] = len(completion.token_ids)
        return text, start


def choices(prompt_index: int, n: int, out: RequestOutput) -> list[tuple[int, CompletionOutput]]:
    """The output's completions and their choice indices: the n choices of the first prompt, then of
    the second, ... An output the engine failed (finish_reason "error") raises EngineError."""
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        raise EngineError(f"The engine failed on request {out.request_id}: {out.error or 'unknown error'}")
    return [(prompt_index * n + c.index, c) for c in out.outputs]
