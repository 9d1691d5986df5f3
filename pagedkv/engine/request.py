"""Requests and sampling parameters, and what `generate` returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedkv.checks import check_bool, check_float, check_int, check_optional_int
from pagedkv.engine.checks import check_logit_bias, check_stop_strings, check_token_ids
from pagedkv.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedkv.worker.states import RowSamplingParams

SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily, as in vLLM: logits divided by a temperature of 1e-38
overflow to inf, and their softmax is NaN."""

MAX_LOGPROBS = 20
"""Most `logprobs` a request may ask for (vLLM's default `max_logprobs`)."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds taken (any int64 or uint64); a seed is used modulo 2**64 as the key of the request's noise."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Every field is checked when the object is made (and again when a request is added, in case
    it was changed since): a wrong type is a `TypeError`, a value out of range a `ValueError`,
    so a bad value never reaches the middle of an engine step. Integer numpy / torch scalars
    are accepted and stored as Python ints.
    """

    n: int = 1
    """Outputs to generate for the prompt, >= 1: n requests that share the prompt's KV cache blocks
    (through prefix caching), returned together as one RequestOutput with n CompletionOutputs. A
    seeded request's i-th output draws with seed + i, as in vLLM."""
    temperature: float = 1.0
    """0 means greedy (argmax), and so does anything below SAMPLING_EPS (1e-5)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all (vLLM also spells that -1; here it is 0)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to top_p, in (0, 1]."""
    min_p: float = 0.0
    """Keep only tokens at least min_p times as likely as the most likely one, in [0, 1]; 0 keeps all."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already, in [-2, 2] (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it, in [-2, 2] (OpenAI's)."""
    repetition_penalty: float = 1.0
    """> 0; a token of the prompt or the output has its logit divided by it when positive and multiplied
    by it when negative (the CTRL paper's, as `transformers` applies it); 1 changes nothing."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's); None: none."""
    seed: int | None = None
    """Per-request random seed: the same seed gives the same tokens, alone or in any batch, chunked,
    preempted, interrupted or with speculative decoding (the token at a position is drawn from a hash
    of the seed and the position: pagedkv/worker/sampling_metadata.py). None: a seed derived from the
    engine's `seed` and the request's arrival number (the how-manieth request the engine got), so two
    identical unseeded requests draw differently and a whole engine run is reproducible."""
    max_tokens: int = 16
    """Most new tokens, >= 1."""
    min_tokens: int = 0
    """Fewest new tokens, in [0, max_tokens]: until then the end-of-sequence tokens and `stop_token_ids`
    cannot be sampled and `stop` strings are not looked for."""
    ignore_eos: bool = False
    """Keep going past the model's end-of-sequence tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop when the output text contains any of these strings (a str is one string; None: none). The
    text is cut before the string unless `include_stop_str_in_output`; the tokens are kept whole."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop after any of these token ids (it is kept in the output); None means none."""
    include_stop_str_in_output: bool = False
    """Keep the matched `stop` string at the end of the output text."""
    logprobs: int | None = None
    """Return, with each output token, its log-probability and those of the `logprobs` most likely
    tokens (of the model's distribution, before temperature, penalties and filters, as vLLM's default);
    at most MAX_LOGPROBS. None: none."""
    prompt_logprobs: int | None = None
    """Return, for each prompt token after the first, its log-probability given the tokens before it
    and those of the `prompt_logprobs` most likely tokens there; at most MAX_LOGPROBS. None: none. (Such
    a request computes its whole prompt: it does not read the prefix cache, as in vLLM.)"""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range; normalise numbers to Python int / float."""
        self.n = check_int("n", self.n, 1, hint=" (how many outputs of the prompt)")
        self.temperature = check_float("temperature", self.temperature, 0, hint=" (0 = greedy)")
        self.top_k = check_int("top_k", self.top_k, 0, hint=" (0 keeps all tokens)")
        self.top_p = check_float("top_p", self.top_p, 0, 1, low_open=True, hint=" (1 keeps all tokens)")
        self.min_p = check_float("min_p", self.min_p, 0, 1, hint=" (0 keeps all tokens)")
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2, 2, hint=" (0: none)")
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2, 2, hint=" (0: none)")
        self.repetition_penalty = check_float(
            "repetition_penalty", self.repetition_penalty, 0, low_open=True, hint=" (1: none)"
        )
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.seed = check_optional_int("seed", self.seed, *SEED_RANGE, hint=" or None (any int64 or uint64)")
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = check_int(
            "min_tokens", self.min_tokens, 0, self.max_tokens, hint=f" (at most max_tokens={self.max_tokens})"
        )
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.stop = check_stop_strings(self.stop)
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = check_token_ids("stop_token_ids", stop)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.logprobs = check_optional_int(
            "logprobs", self.logprobs, 0, MAX_LOGPROBS, hint=" or None (how many of the most likely tokens to return)"
        )
        self.prompt_logprobs = check_optional_int(
            "prompt_logprobs",
            self.prompt_logprobs,
            0,
            MAX_LOGPROBS,
            hint=" or None (how many of the most likely tokens to return per prompt position)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


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
    prompt: str | None = None
    """The prompt text, when it was given as a string."""
    output_token_ids: list[int] = field(default_factory=list)
    """Sampled so far; grows through `append_output_token_id` (which keeps `all_token_ids` too)."""
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for its next decode step (speculative decoding), verified after its last
    token; PLACEHOLDER_TOKEN_ID (-1) where a draft model in the runner proposes them then."""
    num_output_placeholders: int = 0
    """Tokens sampled in a step that ran but whose ids the host has not read yet (async scheduling:
    at most one). The next step computes them all the same: their ids come from the device."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error" once finished."""
    stop_reason: int | str | None = None
    """With finish_reason "stop": the `stop` string or stop token id that ended it (None: end of sequence)."""
    error: str | None = None
    """Why the request failed (finish_reason "error")."""
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was (last) admitted: not computed then."""
    sampling_seed: int = 0
    """The seed its random draws are hashed from: `SamplingParams.seed`, or one the engine derived."""
    output_logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)
    """Per output token, the log-probabilities asked for with SamplingParams.logprobs (token id -> logprob)."""
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    """Turns output_token_ids into text (None: the model has no tokenizer, the text stays "")."""
    row_sampling: RowSamplingParams = field(default_factory=RowSamplingParams, repr=False)
    """Its sampling parameters as its row in the runner holds them (set by the engine when it is added)."""
    parent_id: str | None = None
    """With SamplingParams.n > 1: the id the caller knows; this request is its output number `index`
    (its own id, f"{index}_{parent_id}" as in vLLM, stays inside the engine)."""
    index: int = 0
    """Which of its prompt's n outputs it is (CompletionOutput.index)."""
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list, repr=False)
    """With SamplingParams.prompt_logprobs: per prompt token so far, {token id: logprob}, None first."""
    num_text_chars_searched: int = 0
    """Characters of its text already searched for `stop` strings (each step searches only what is new)."""
    text_length: int | None = None
    """Set when a `stop` string ended it: its text is cut to this many characters (the tokens stay whole)."""
    _token_ids: list[int] = field(init=False, repr=False)
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The engine reads its own list and count only: `prompt_token_ids` is handed out in every
        # RequestOutput, and a caller who changes it must not change the request.
        self._token_ids = self.prompt_token_ids + self.output_token_ids
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: one list kept up to date (read it, do not change it)."""
        return self._token_ids

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]`, as a new list (the runner asks every step)."""
        return self._token_ids[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the request will have once the host reads what the steps in flight sampled."""
        return len(self._token_ids) + self.num_output_placeholders

    def surely_finished(self, max_model_len: int) -> bool:
        """Whether the tokens in flight end the request whatever their ids (its length limits)."""
        n = self.num_output_placeholders
        return len(self.output_token_ids) + n >= self.sampling_params.max_tokens or self.num_tokens + n >= max_model_len

    def logprobs_so_far(self) -> list[dict[int, float]] | None:
        """A copy of `output_logprobs` for an output, or None when the request asked for none."""
        return None if self.sampling_params.logprobs is None else list(self.output_logprobs)

    def output(self, text: str) -> RequestOutput:
        """Its state as a caller sees it, `text` being its output tokens' text so far (cut where a
        `stop` string ended it). With n > 1 it carries the id the caller knows and its index; whether
        the whole prompt is finished is the engine's to say (pagedkv/engine/parallel_sampling.py)."""
        params, shown = self.sampling_params, self.text_length
        if shown is None and self.finish_reason is None and params.stop and not params.include_stop_str_in_output:
            # Held back, as vLLM's detokenizer does (stop_buffer_length): the last len(longest stop) - 1
            # characters may be the start of a stop string the final text leaves out, and a streamed text
            # must only grow.
            shown = max(len(text) - max(map(len, params.stop)) + 1, 0)
        completion = CompletionOutput(
            self.index,
            text[:shown],
            list(self.output_token_ids),
            self.finish_reason,
            self.logprobs_so_far(),
            self.stop_reason,
        )
        asked = params.prompt_logprobs is not None
        return RequestOutput(
            request_id=self.request_id if self.parent_id is None else self.parent_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            error=self.error,
            prompt_logprobs=list(self.prompt_logprobs) if asked else None,
        )

    def check_stop(self, max_model_len: int) -> bool:
        """Set the finish reason after a new token; True when the request is done. Before `min_tokens`
        outputs only the length limits end it (as vllm/v1/core/sched/utils.py check_stop)."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if len(self.output_token_ids) < params.min_tokens:
            pass
        elif not params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason = "stop"
        elif last in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", last
        if self.finish_reason is None and (
            len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len
        ):
            self.finish_reason = "length"
        return self.finish_reason is not None

    def check_stop_strings(self, text: str) -> bool:
        """Search the text that is new since the last call for the `stop` strings (the text of the
        first `min_tokens` outputs is never searched, though a string may begin in it); on a match set
        the finish reason, the stop reason and the length its text is cut to, and return True. The
        engine finishes the request (its blocks freed) if it was running."""
        params = self.sampling_params
        new_chars, self.num_text_chars_searched = len(text) - self.num_text_chars_searched, len(text)
        if len(self.output_token_ids) <= params.min_tokens:
            return False
        found = find_stop_string(text, new_chars, params.stop, params.include_stop_str_in_output)
        if found is None:
            return False
        self.stop_reason, self.text_length = found
        self.finish_reason = "stop"
        return True


@dataclass
class CompletionOutput:
    """One generated continuation."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    """With SamplingParams.logprobs: per token, {token id: log-probability} of the sampled token and
    the most likely ones."""
    stop_reason: int | str | None = None
    """What stopped it, when finish_reason is "stop": the matched `stop` string or stop token id (None
    for an end-of-sequence token), as in vLLM."""


@dataclass
class RequestOutput:
    """A request's state after a step: what `LLM.step` streams and `LLM.generate` returns.

    `outputs[0]` holds everything generated so far (token ids and text, cumulative as in vLLM's
    default), `finished` says whether more will come. With SamplingParams.n > 1, `generate` returns the
    n completions in `outputs` (by index), and each output `LLM.step` streams holds one child's, its
    `index` saying which; `finished` is then set once every child is done. A request that failed is finished with
    `outputs[0].finish_reason == "error"` and the reason in `error`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token, {token id: log-probability} of that token
    and the most likely ones at its position; None for the first token (nothing comes before it)."""
