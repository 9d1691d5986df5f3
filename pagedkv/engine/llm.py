"""`LLM`: the public front end, in vLLM's shape.

    llm = LLM(model="tiny")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, llm.stats

One `step()` = schedule -> run the model -> sample -> update; step listeners see each one.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedkv.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_dtype,
)
from pagedkv.engine.request import CompletionOutput, Request, RequestOutput, SamplingParams
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.models.loader import PRESETS, load_config
from pagedkv.models.tokenizer import get_tokenizer
from pagedkv.platforms import default_device
from pagedkv.worker.model_runner import ModelRunner, StepResult

Prompt = str | dict[str, Any]


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    """Prompt (and recomputed) tokens run through the model."""
    num_decode_tokens: int = 0
    num_finished_requests: int = 0
    model_time_s: float = 0.0


@dataclass
class StepEvent:
    """Everything a listener (trace recorder, widget) may want to know about one step.

    Read it inside the listener: `result` holds views of the runner's persistent buffers (the
    device block tables, for one), which the next step overwrites. `block_ids` is a copy.
    """

    step: int
    scheduler_output: SchedulerOutput
    result: StepResult
    block_ids: dict[str, list[list[int]]]
    """Request id -> per KV cache group, its block table row during the step."""
    num_free_blocks: list[int]
    """Per KV cache group, after the step."""
    finished_req_ids: list[str]
    runner: ModelRunner = field(repr=False)


StepListener = Callable[[StepEvent], None]


class LLM:
    """A small paged-KV serving engine: continuous batching over one model on one device."""

    def __init__(
        self,
        model: str = "tiny",
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        attention_backend: str | None = None,
        enable_chunked_prefill: bool = True,
        kv_cache_memory: int | None = None,
        memory_utilization: float = 0.9,
        seed: int = 0,
    ) -> None:
        device = torch.device(device) if device is not None else default_device()
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        model_cfg = load_config(model)
        if dtype is None:  # CPU: float32 (fast and exact there); GPU: bfloat16
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        max_model_len = max_model_len or model_cfg.max_position_embeddings
        if max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({model_cfg.max_position_embeddings})."
            )
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}.")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}) so that any prompt fits one step."
            )
        self.config = EngineConfig(
            model_config=ModelConfig(model=model, dtype=parse_dtype(dtype), max_model_len=max_model_len, seed=seed),
            cache_config=CacheConfig(
                block_size=block_size, num_kv_blocks=num_kv_blocks,
                kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            device=device,
            attention_backend=attention_backend,
        )
        self.model_config = model_cfg
        self.tokenizer = get_tokenizer(model, model in PRESETS)
        self.eos_token_ids = self._eos_token_ids(model)
        self.runner = ModelRunner(self.config, model_cfg)
        self.runner.initialize_kv_cache(self.runner.determine_kv_cache_config())
        self.kv_cache_manager = KVCacheManager(self.runner.kv_cache_config)
        self.scheduler = Scheduler(self.config.scheduler_config, max_model_len, self.kv_cache_manager)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._listeners: list[StepListener] = []
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}

    def _eos_token_ids(self, model: str) -> list[int]:
        ids = list(self.model_config.eos_token_id)
        gen = Path(model) / "generation_config.json"
        if model not in PRESETS and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
        return sorted(set(ids))

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # ---- listeners -------------------------------------------------------------------

    def add_step_listener(self, listener: StepListener) -> Callable[[], None]:
        """Call `listener(StepEvent)` after every step; returns a function that detaches it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # ---- requests --------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        """Queue one prompt; returns its request id."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"A dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}.")
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"Model {self.config.model_config.model!r} has no tokenizer; pass "
                    "{'prompt_token_ids': [...]} instead of a string."
                )
            token_ids = self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"A prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}.")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"Prompt token ids must be in [0, {vocab}) for this model.")
        request = Request(str(next(self._ids)), token_ids, params, eos_token_ids=self.eos_token_ids)
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        return request.request_id

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            raise RuntimeError("Nothing could be scheduled although requests are waiting.")
        block_ids = {s.request.request_id: self.kv_cache_manager.get_block_ids(s.request.request_id) for s in sched.scheduled}
        start = time.perf_counter()
        result = self.runner.execute_model(sched, block_ids)
        params = [self._requests[r].sampling_params for r in result.batch.sampling_req_ids]
        tokens = self.sampler(result.logits, result.batch.sampling_req_ids, params) if params else []
        self.stats.model_time_s += time.perf_counter() - start
        finished = self.scheduler.update(sched, dict(zip(result.batch.sampling_req_ids, tokens)))
        for request in finished:
            self.sampler.forget(request.request_id)
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted_req_ids)
        self.stats.num_prefill_tokens += sched.num_prefill_tokens
        self.stats.num_decode_tokens += sched.num_decode_tokens
        self.stats.num_finished_requests += len(finished)
        if self._listeners:
            event = StepEvent(
                step=self.stats.num_steps, scheduler_output=sched, result=result, block_ids=block_ids,
                num_free_blocks=[p.num_free_blocks for p in self.kv_cache_manager.block_pools],
                finished_req_ids=[r.request_id for r in finished], runner=self.runner,
            )
            for listener in list(self._listeners):
                listener(event)
        return finished

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"Got {len(prompts)} prompts but {len(sampling_params)} sampling params.")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        show = use_tqdm if use_tqdm is not None else len(ids) >= 8
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
            while self.has_unfinished_requests():
                bar.update(len(self.step()))
        return [self._output(self._requests.pop(i), p) for i, p in zip(ids, prompts)]

    def _output(self, request: Request, prompt: Prompt) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(request.output_token_ids), request.finish_reason)],
        )
