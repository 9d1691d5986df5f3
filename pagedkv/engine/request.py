"""Requests and sampling parameters, and what `generate` returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop."""

    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to top_p."""
    seed: int | None = None
    """Per-request random seed: the same seed gives the same tokens."""
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """A prompt on its way through the engine.

    `num_computed_tokens` counts tokens whose K/V are in the cache. A preempted request
    drops its blocks and goes back to 0: its prompt *and* output are recomputed (a longer
    prefill) before it decodes again, so nothing is lost.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def check_stop(self, max_model_len: int) -> bool:
        """Set the finish reason after a new token; True when the request is done."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason = "stop"
        elif last in params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated continuation."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, in prompt order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
