"""The OpenAI API's requests and responses as pydantic models (as vllm/entrypoints/openai/protocol.py).

A request is parsed (types) by pydantic, then turned into a `SamplingParams`, whose own checks
decide the ranges: one rule for a value, whether it comes from Python or over HTTP. Fields that
OpenAI does not have (top_k, min_p, repetition_penalty, ...) are vLLM's extra parameters, which the
openai client sends with `extra_body={...}`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedkv.engine.request import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server refuses: OpenAI's error JSON with `status` (400, 404), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class OpenAIBaseModel(BaseModel):
    """Unknown fields are ignored with a warning, as vLLM does (a client may send OpenAI fields that
    this server does not know; a typo then shows in the server's log)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> OpenAIBaseModel:
        if self.model_extra:
            logger.warning("%s: ignoring unknown field(s) %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    """Send a last chunk with the token counts (and `usage: null` in the others)."""


class SamplingRequest(OpenAIBaseModel):
    """The fields shared by /v1/completions and /v1/chat/completions, and their SamplingParams."""

    model: str | None = None
    """The served model's name (`--served-model-name`); None: the one model served."""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[int, float] | None = None
    """Token id -> bias; JSON's keys are strings, which pydantic reads as ints."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """Also return each choice's token ids (`token_ids`, vLLM's extra): compare tokens, not only text."""

    RENAMED: ClassVar[dict[str, str]] = {}
    """SamplingParams field -> the request field it comes from, where the names differ (for errors)."""

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a value SamplingParams refuses is a RequestError naming its field."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only for stream=true.", "stream_options")
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
                top_p=1.0 if self.top_p is None else self.top_p,
                # vLLM spells "keep all" -1 (and None); SamplingParams spells it 0.
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.logit_bias,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
            )
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), self.param_of(str(error))) from None

    def param_of(self, message: str) -> str | None:
        """The request field a refusal of SamplingParams or of the engine is about: such messages begin
        with the field's name ("temperature must be ...", "logit_bias maps token ids ...", "stop_token_ids
        names token id ..."); or the prompt + max_tokens that do not fit."""
        for word in re.findall(r"\w+", message)[:3]:
            if word in SamplingParams.__dataclass_fields__:
                return self.RENAMED.get(word, word)
        if "max_tokens" in message:
            return self.RENAMED.get("max_tokens", "max_tokens")
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (https://platform.openai.com/docs/api-reference/completions/create)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """One prompt (text or token ids) or a batch of them; each gets `n` choices."""
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    """Put the prompt's text in front of each choice's text."""
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a request: a str, a list of ids, or a non-empty list of either."""
        prompt = self.prompt
        if not prompt:
            raise RequestError("prompt is empty: give a text, a list of token ids, or a list of either.", "prompt")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # a str, or a list[int]: one prompt of ids
        return [p for p in prompt if isinstance(p, (str, list))]

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise RequestError("suffix is not supported by this server.", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of={self.best_of} is not supported: leave it out (or equal to n).", "best_of")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's content as text; only text parts are understood (no images, no audio)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(
                    f"messages[{index}].content: a part of type {part.type!r} is not supported (text parts only).",
                    f"messages.{index}.content",
                )
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat/create)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    """Deprecated by OpenAI for max_completion_tokens; None: until the model's max_model_len, as vLLM."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    """Render the template's cue for the assistant's turn after the messages (vLLM's extra)."""
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    RENAMED: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        if self.tools is not None:
            raise RequestError("tools is not supported by this server.", "tools")
        if self.response_format is not None and self.response_format.get("type") != "text":  # text: the default
            raise RequestError(
                f"response_format {self.response_format!r} is not supported by this server (only plain text).",
                "response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true.", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            # All the room the prompt leaves (vLLM's default); at least 1, so a prompt too long for
            # the model is refused by the engine's own check, which names max_model_len.
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


# ---- responses ------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """The choice's token ids (vLLM's extra, which lets a client compare tokens, not only text)."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage | None = None
    delta: ChatResponseMessage | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
