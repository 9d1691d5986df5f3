"""POST /v1/completions (as vllm/entrypoints/openai/serving_completion.py): prompts in, text out,
whole or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.request import CompletionOutput
from pagedkv.entrypoints.openai.metrics import RequestTracker
from pagedkv.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    RequestError,
    UsageInfo,
    random_id,
)
from pagedkv.entrypoints.openai.serving_engine import (
    SSE_DONE,
    Deltas,
    OpenAIServing,
    Outputs,
    chain,
    choices,
    error_json,
    failure_message,
    sse,
)


class OpenAIServingCompletion(OpenAIServing):
    """Turns a CompletionRequest into engine requests, one per prompt, and their outputs into choices."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        params = request.to_sampling_params()
        if request.echo and request.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported by this server.", "echo")
        prompts = request.prompts()
        token_ids = [self.prompt_token_ids(p) for p in prompts]
        # With echo, each choice's text begins with its prompt's (ids given as such are decoded).
        echoed = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if request.echo else None
        request_id = random_id("cmpl")
        tracker = self.metrics.tracker()
        merged, first = await self.start(request, token_ids, params, request_id, tracker)
        num_choices = len(prompts) * params.n
        usage = UsageInfo(prompt_tokens=sum(map(len, token_ids)))
        outputs = chain(first, merged)
        if request.stream:
            stream = self._stream(request, request_id, outputs, merged, tracker, num_choices, usage, echoed)
            return StreamingResponse(stream, media_type="text/event-stream")
        final: dict[int, CompletionOutput] = {}
        try:
            async for i, out in outputs:
                for index, completion in choices(i, params.n, out):
                    tracker.observe(index, completion)
                    final[index] = completion
                if await raw_request.is_disconnected():  # nobody to answer: abort (the finally below)
                    return Response(status_code=499)
        finally:
            await merged.aclose()
            tracker.end(num_choices)
        results = []
        for index in range(num_choices):
            completion = final[index]
            prefix = echoed[index // params.n] if echoed is not None else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._logprobs(completion, 0, request.logprobs, len(prefix))[0]
            results.append(self._choice(request, index, prefix + completion.text, completion, logprobs))
        usage.completion_tokens = sum(len(c.token_ids) for c in final.values())
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        response = CompletionResponse(id=request_id, model=self.model_name, choices=results, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        outputs: Outputs,
        merged: Outputs,
        tracker: RequestTracker,
        num_choices: int,
        usage: UsageInfo,
        echoed: list[str] | None,
    ) -> AsyncIterator[str]:
        """One chunk per new piece of a choice; the engine's outputs are cumulative, so each chunk
        holds what its choice's text and tokens gained since the last."""
        deltas = Deltas()
        offsets: dict[int, int] = {}  # choice -> text_offset of its next token (logprobs)
        completion_tokens: dict[int, int] = {}
        try:
            async for i, out in outputs:
                for index, completion in choices(i, request.n, out):
                    tracker.observe(index, completion)
                    completion_tokens[index] = len(completion.token_ids)
                    first = not deltas.started(index)
                    delta = deltas.take(index, completion)
                    if delta is None:
                        continue
                    text, start = delta
                    if first and echoed is not None:
                        text = echoed[i] + text
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs, offsets[index] = self._logprobs(
                            completion, start, request.logprobs, offsets.get(index, 0)
                        )
                    choice = self._choice(request, index, text, completion, logprobs, start)
                    yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[choice]))
            if request.include_usage:
                usage.completion_tokens = sum(completion_tokens.values())
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage))
        except Exception as error:  # the status (200) is sent: the stream's last event says what failed
            yield sse(error_json(failure_message(error), 500))
        finally:
            await merged.aclose()  # a client gone mid-stream: the engine requests are aborted here
            tracker.end(num_choices)
        yield SSE_DONE

    def _choice(
        self,
        request: CompletionRequest,
        index: int,
        text: str,
        completion: CompletionOutput,
        logprobs: CompletionLogprobs | None,
        first_token: int = 0,
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=completion.token_ids[first_token:] if request.return_token_ids else None,
        )

    def _logprobs(
        self, completion: CompletionOutput, start: int, k: int, offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """OpenAI's logprobs of the completion's tokens from `start` on, and the text offset after them."""
        result = CompletionLogprobs()
        for token_id, logprobs in zip(completion.token_ids[start:], (completion.logprobs or [])[start:]):
            token = self.token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(logprobs.get(token_id))
            result.top_logprobs.append({self.token_text(t): lp for t, lp in self.top_logprobs(logprobs, k)})
            result.text_offset.append(offset)
            offset += len(token)
        return result, offset
