"""POST /v1/chat/completions (as vllm/entrypoints/openai/serving_chat.py): the messages are rendered
into one prompt by the model's chat template, then generated from like a completion.

The template is the Jinja one a Hugging Face tokenizer keeps (`chat_template` in
tokenizer_config.json, or a chat_template.jinja file beside it), rendered as transformers'
`apply_chat_template` renders it: in a sandbox, with `messages`, `add_generation_prompt` and the
special tokens' text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.request import CompletionOutput
from pagedkv.entrypoints.openai.metrics import RequestTracker
from pagedkv.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    RequestError,
    TopLogprob,
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


class ChatTemplate:
    """A model's chat template, compiled once; `render(messages)` is the prompt's text."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:  # templates call it to refuse a conversation
            raise TemplateError(message)

        # trim_blocks / lstrip_blocks as transformers sets them, so a template renders as it does there.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except TemplateError as error:
            raise RequestError(f"The chat template refused the messages: {error}", "messages") from None

    @staticmethod
    def load(model_dir: Path) -> ChatTemplate | None:
        """The template of the checkpoint in `model_dir`, or None when it has none."""
        config: dict[str, Any] = {}
        config_file = model_dir / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        jinja_file = model_dir / "chat_template.jinja"
        source = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        special = {
            name: value if isinstance(value, str) else value.get("content", "")
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(value := config.get(name), (str, dict))
        }
        return ChatTemplate(source, special)


class OpenAIServingChat(OpenAIServing):
    """Renders the messages with the chat template, then streams or returns the assistant's replies."""

    def __init__(self, *args: Any, chat_template: ChatTemplate | None, model_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.model_dir = model_dir

    def prompt(self, request: ChatCompletionRequest) -> str:
        if self.chat_template is None:
            raise RequestError(
                f"The model {self.model_name!r} has no chat template (no 'chat_template' in "
                f"{self.model_dir / 'tokenizer_config.json'} and no chat_template.jinja), so it cannot chat: "
                "use /v1/completions with a prompt, or give the model a template.",
                "messages",
            )
        if not request.messages:
            raise RequestError("messages is empty: give at least one message.", "messages")
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(request.messages)]
        text = self.chat_template.render(messages, request.add_generation_prompt)
        # Many templates write the BOS token's text first, and a tokenizer that adds BOS would add a
        # second: keep the tokenizer's (vLLM encodes a chat with add_special_tokens=False instead).
        bos = self.chat_template.special_tokens.get("bos_token")
        if bos and text.startswith(bos) and self.tokenizer.encode(""):
            text = text[len(bos) :]
        return text

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        token_ids = self.prompt_token_ids(self.prompt(request))
        params = request.to_sampling_params(len(token_ids), self.max_model_len)
        request_id = random_id("chatcmpl")
        tracker = self.metrics.tracker()
        merged, first = await self.start(request, [token_ids], params, request_id, tracker)
        usage = UsageInfo(prompt_tokens=len(token_ids))
        outputs = chain(first, merged)
        if request.stream:
            stream = self._stream(request, request_id, outputs, merged, tracker, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        final: dict[int, CompletionOutput] = {}
        try:
            async for _, out in outputs:
                for index, completion in choices(0, params.n, out):
                    tracker.observe(index, completion)
                    final[index] = completion
                if await raw_request.is_disconnected():  # nobody to answer: abort (the finally below)
                    return Response(status_code=499)
        finally:
            await merged.aclose()
            tracker.end(params.n)
        results = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(role="assistant", content=completion.text),
                logprobs=self._logprobs(request, completion, 0),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                token_ids=completion.token_ids if request.return_token_ids else None,
            )
            for index, completion in sorted(final.items())
        ]
        usage.completion_tokens = sum(len(c.token_ids) for c in final.values())
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=results, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        outputs: Outputs,
        merged: Outputs,
        tracker: RequestTracker,
        usage: UsageInfo,
    ) -> AsyncIterator[str]:
        """As OpenAI streams a chat: a first chunk per choice with the role, then the content's pieces."""

        def chunk(choice: ChatChoice) -> str:
            return sse(
                ChatCompletionResponse(
                    id=request_id, object="chat.completion.chunk", model=self.model_name, choices=[choice]
                )
            )

        deltas = Deltas()
        announced: set[int] = set()  # choices whose first chunk (the role) is sent
        completion_tokens: dict[int, int] = {}
        try:
            async for _, out in outputs:
                for index, completion in choices(0, request.n, out):
                    tracker.observe(index, completion)
                    completion_tokens[index] = len(completion.token_ids)
                    if index not in announced:
                        announced.add(index)
                        yield chunk(ChatChoice(index=index, delta=ChatResponseMessage(role="assistant", content="")))
                    delta = deltas.take(index, completion)
                    if delta is None:
                        continue
                    text, start = delta
                    choice = ChatChoice(
                        index=index,
                        delta=ChatResponseMessage(content=text),
                        logprobs=self._logprobs(request, completion, start),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        token_ids=completion.token_ids[start:] if request.return_token_ids else None,
                    )
                    yield chunk(choice)
            if request.include_usage:
                usage.completion_tokens = sum(completion_tokens.values())
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(
                    ChatCompletionResponse(
                        id=request_id, object="chat.completion.chunk", model=self.model_name, choices=[], usage=usage
                    )
                )
        except Exception as error:  # the status (200) is sent: the stream's last event says what failed
            yield sse(error_json(failure_message(error), 500))
        finally:
            await merged.aclose()  # a client gone mid-stream: the engine request is aborted here
            tracker.end(request.n)
        yield SSE_DONE

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput, start: int
    ) -> ChatLogprobs | None:
        """OpenAI's chat logprobs of the completion's tokens from `start` on (None unless asked for)."""
        if not request.logprobs:
            return None
        k = request.top_logprobs or 0
        content = []
        for token_id, logprobs in zip(completion.token_ids[start:], (completion.logprobs or [])[start:]):
            top = [self._top(t, lp) for t, lp in self.top_logprobs(logprobs, k)]
            content.append(ChatTokenLogprob(**self._top(token_id, logprobs[token_id]).model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
