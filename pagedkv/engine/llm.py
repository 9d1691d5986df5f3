"""`LLM`: the public front end, in vLLM's shape.

    llm = LLM(model="tiny")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, llm.stats

Or drive it yourself and stream (what a server does):

    request_id = llm.add_request("Hello", SamplingParams(max_tokens=8))
    while llm.has_unfinished_requests():
        for out in llm.step():              # one RequestOutput per request that got a token
            print(out.request_id, out.outputs[0].token_ids[-1:], out.finished)

One `step()` = schedule -> run the model -> sample -> update; step listeners see each one.

Speed on a GPU is the default (compiled, CUDA graphs: pagedkv.worker.cudagraph); `enforce_eager=True` runs eagerly.
"""

from __future__ import annotations

import logging
import textwrap
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedkv.checks import check_optional_bool
from pagedkv.config import CUDAGraphMode
from pagedkv.engine.arg_utils import EngineArgs, engine_args_doc
from pagedkv.engine.checks import check_prompt
from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize_batch
from pagedkv.engine.events import EngineStats, StepEvent, StepListener
from pagedkv.engine.parallel_sampling import ParentRequest, child_params, child_request_id, merge_outputs
from pagedkv.engine.rejection_sampler import RejectionSampler
from pagedkv.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from pagedkv.engine.sampler import Sampler, SamplerOutput, check_vocabulary, row_sampling_params, with_logprobs
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.interrupts import deferred_interrupts
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import SlidingWindowSpec
from pagedkv.models.loader import PRESETS, generation_eos_token_ids
from pagedkv.models.tokenizer import Tokenizer, get_tokenizer
from pagedkv.ranges import phase_range
from pagedkv.spec_decode.ngram_proposer import NgramProposer
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, SampledTokens, ScheduledTokens
from pagedkv.worker.model_runner import ModelRunner, StepResult
from pagedkv.worker.sampling_metadata import derive_seed
from pagedkv.worker.states import to_device
from pagedkv.worker.tp_executor import EngineDeadError, TensorParallelExecutor

logger = logging.getLogger("pagedkv")

Prompt = str | dict[str, Any]
"""Text, or {"prompt_token_ids": [...]}."""


@dataclass
class _LaunchedStep:
    """A step whose forward and sampling are launched; its samples are booked by a later `_book`."""

    sched: SchedulerOutput
    result: StepResult
    requests: list[Request]
    """The requests that sample, in the order of the sampler's rows."""
    sampled: SamplerOutput
    """Its copy on the host (on its way: `rows()` waits for it)."""
    sampled_tokens: SampledTokens
    """The sampled ids on the device, which the next step's placeholder tokens read."""
    start: float
    number: int
    """The step's number, counted from the engine's first launch (named in its profiler ranges)."""
    prompt_logprobs: tuple[list[tuple[Request, int, int]], SamplerOutput] | None = None
    """With prompt logprobs asked: per request (first position, positions), and their logprobs (its token
    ids are the prompt tokens that follow each position), on their way to the host."""


class LLM:
    """A small paged-KV serving engine: continuous batching over one model on one device.

    Its arguments are the fields of `EngineArgs` (pagedkv.engine.arg_utils, each documented
    there, with its defaults), all checked before anything is built: a wrong type is a `TypeError`,
    a value out of range a `ValueError`, each naming the argument.
    """

    def __init__(
        self,
        model: str = EngineArgs.model,
        *,
        device: str | torch.device | None = EngineArgs.device,
        dtype: str | torch.dtype | None = EngineArgs.dtype,
        block_size: int = EngineArgs.block_size,
        num_kv_blocks: int | None = EngineArgs.num_kv_blocks,
        max_num_seqs: int = EngineArgs.max_num_seqs,
        max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens,
        max_model_len: int | None = EngineArgs.max_model_len,
        attention_backend: str | None = EngineArgs.attention_backend,
        layer_attention_backends: dict[str, str] | None = EngineArgs.layer_attention_backends,
        enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill,
        kv_cache_dtype: str = EngineArgs.kv_cache_dtype,
        kv_cache_scales: dict[str, tuple[float, float]] | None = EngineArgs.kv_cache_scales,
        calculate_kv_scales: bool = EngineArgs.calculate_kv_scales,
        kv_cache_memory: int | None = EngineArgs.kv_cache_memory,
        gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization,
        seed: int = EngineArgs.seed,
        cudagraph_mode: CUDAGraphMode | str | None = EngineArgs.cudagraph_mode,
        enforce_eager: bool = EngineArgs.enforce_eager,
        compile: bool | None = EngineArgs.compile,
        max_cudagraph_capture_size: int | None = EngineArgs.max_cudagraph_capture_size,
        tensor_parallel_size: int = EngineArgs.tensor_parallel_size,
        enable_prefix_caching: bool | None = EngineArgs.enable_prefix_caching,
        async_scheduling: bool | None = EngineArgs.async_scheduling,
        speculative_config: dict[str, Any] | None = EngineArgs.speculative_config,
        batch_invariant: bool | None = EngineArgs.batch_invariant,
    ) -> None:
        # Every argument, by name, before anything below rebinds one (`model` is); passed on as one
        # expression over EngineArgs' fields, so no argument can be dropped from the call silently
        # (a field missing from this signature is a KeyError; test_llm_signature_lists_the_engine_args
        # checks the other way round).
        values = dict(locals())
        args = EngineArgs(**{f.name: values[f.name] for f in fields(EngineArgs)})
        self.config, model_cfg = args.create_engine_config()
        self.model_config = model_cfg
        model = self.config.model_config.model
        self.tokenizer = get_tokenizer(model, model in PRESETS)
        self.eos_token_ids = self._eos_token_ids(model)
        self._executor: TensorParallelExecutor | None = None
        """With tensor_parallel_size > 1: runs each step on every rank (self.runner is rank 0's)."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            self._executor = TensorParallelExecutor(self.config, model_cfg)
            self.runner = self._executor.runner
        else:
            self.runner = ModelRunner(self.config, model_cfg)
        for argument, names in (
            ("layer_attention_backends", self.config.layer_attention_backends),
            ("kv_cache_scales", self.config.cache_config.kv_cache_scales),
        ):
            unknown = sorted(set(names) - set(self.runner.attn_layers))
            if unknown:
                self.shutdown()
                raise ValueError(
                    f"{argument} names no attention layer {unknown}; the layers are {list(self.runner.attn_layers)}."
                )
        if self._executor is None:
            self.runner.initialize_kv_cache(self.runner.determine_kv_cache_config())
            self.runner.capture_model()
        self.prefix_caching = self._prefix_caching(args.enable_prefix_caching)
        """Whether full blocks are hashed and shared between requests with the same prefix."""
        self.kv_cache_manager = KVCacheManager(self.runner.kv_cache_config, enable_caching=self.prefix_caching)
        self.scheduler = Scheduler(
            self.config.scheduler_config, self.config.model_config.max_model_len, self.kv_cache_manager
        )
        self.sampler = Sampler(self.config.model_config.batch_invariant)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.speculative_config = self.config.speculative_config
        """Speculative decoding (pagedkv.config.SpeculativeConfig), or None."""
        self._ngram: NgramProposer | None = None
        spec = self.speculative_config
        if spec is not None and spec.method == "ngram":
            self._ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.stats = EngineStats()
        self._listeners: list[StepListener] = []
        self._num_added = 0
        """Requests added so far: the next one's id and arrival number (an unseeded request's seed)."""
        # Unfinished requests only: a record goes when its final output is returned or it is aborted.
        self._requests: dict[str, Request] = {}
        """By the engine's own id (a child of a prompt with n > 1: f"{index}_{parent id}")."""
        self._parents: dict[str, ParentRequest] = {}
        """Prompts with n > 1 that have unfinished children, by the id the caller knows."""
        # Outputs of a step whose listener raised: the step had run, so they are kept, and the
        # next step() returns them first (else a request finishing in that step would be lost).
        self._undelivered: list[RequestOutput] = []
        self.async_scheduling = self.config.scheduler_config.async_scheduling
        """Plan and launch step N+1 while the GPU runs step N (pagedkv/engine/scheduler.py)."""
        self._launched: deque[_LaunchedStep] = deque()
        """Steps launched whose samples are not booked yet, oldest first (at most 2, under async scheduling)."""
        self._num_launched = 0
        """Steps launched so far: the next one's number (pagedkv.ranges names its phases with it)."""
        self._lock = threading.RLock()
        """Held by a step and by add_request / abort_request: one called from another thread (a server's)
        while a step runs lands after it, not in the middle of its plan, forward or booking."""

    def _prefix_caching(self, requested: bool | None) -> bool:
        """On unless turned off or the model cannot: a sliding-window layer gives blocks back as
        they leave its window, so its blocks do not hold a whole prefix (vLLM's hybrid manager
        handles that case; this engine does not)."""
        windowed = [
            i
            for i, g in enumerate(self.runner.kv_cache_config.kv_cache_groups)
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        ]
        if not windowed or requested is False:
            return requested is not False
        reason = (
            f"prefix caching is not supported for this model: KV cache group(s) {windowed} hold "
            "sliding-window layers, whose blocks leave the window"
        )
        if requested:
            self.shutdown()
            raise ValueError(f"enable_prefix_caching=True: {reason}. Pass enable_prefix_caching=False (or None).")
        logger.info("Prefix caching is off: %s.", reason)
        return False

    def _eos_token_ids(self, model: str) -> list[int]:
        return sorted({*self.model_config.eos_token_id, *generation_eos_token_ids(model, self.model_config.vocab_size)})

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # ---- lifecycle -------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded and outputs decoded with (vLLM's `LLM.get_tokenizer`)."""
        if self.tokenizer is None:
            raise ValueError(
                f"Model {self.config.model_config.model!r} has no tokenizer: its prompts are token ids "
                "({'prompt_token_ids': [...]}) and its outputs are read from CompletionOutput.token_ids."
            )
        return self.tokenizer

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (nothing to do with one rank). Also done when
        the LLM is garbage-collected or the interpreter exits; calling it twice is fine."""
        if self._executor is not None:
            self._executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- listeners -------------------------------------------------------------------

    def add_step_listener(self, listener: StepListener) -> Callable[[], None]:
        """Call `listener(StepEvent)` after every step; returns a function that detaches it."""
        if not callable(listener):
            raise TypeError(f"A step listener is called with each StepEvent: pass a function, got {listener!r}.")
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # ---- requests --------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Queue one prompt; returns its request id: `request_id`, or with None one the engine makes.
        Bad input (or an id in use by an unfinished request) raises and queues nothing.

        With `params.n` > 1 the prompt runs as n requests (pagedkv/engine/parallel_sampling.py), all
        streamed under this id: each `RequestOutput` of `step()` holds one of them, its
        `outputs[0].index` saying which, and `finished` is True on the last output of the last one."""
        with self._lock:
            if request_id is not None:
                self._check_unused(request_id, params.n if isinstance(params, SamplingParams) else 1)
            return self._add(*self._prepare(prompt, params), request_id)

    def _check_unused(self, request_id: object, n: int) -> None:
        """Refuse a caller's request id that is not a str, or that an unfinished request (or, with n > 1,
        one of its children) uses already."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None (the engine makes one), got {request_id!r}.")
        if self._in_use(request_id, n):
            raise ValueError(
                f"request_id {request_id!r} is in use by an unfinished request: pass another one, or None "
                "(the engine makes one)."
            )

    def _in_use(self, request_id: str, n: int) -> bool:
        ids = [request_id] if n == 1 else [request_id] + [child_request_id(request_id, i) for i in range(n)]
        return any(i in self._requests or i in self._parents for i in ids)

    def abort_request(self, request_id: str) -> bool:
        """Stop an unfinished (waiting or running) request now and free its blocks.

        Returns False, and does nothing, for an id that is not unfinished: unknown, aborted
        already, or finished (its last output came from `step`) -- as in vLLM, where a request
        may well finish in the step just before its abort.

        Called from another thread while a step runs, it waits for the step to end, as vLLM's engine
        core takes aborts from its input queue between steps (vllm/v1/engine/core.py): finished
        under a running step, a request would fail the step and every other request in it.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str (what add_request returned), got {request_id!r}.")
        with self._lock:
            parent = self._parents.get(request_id)
            if parent is not None:  # n > 1: every unfinished child
                requests = [c for c in parent.children if c.request_id in self._requests]
            else:
                request = self._requests.get(request_id)
                # A child's own id is the engine's, never a caller's.
                requests = [request] if request is not None and request.parent_id is None else []
            self._abort(requests)
            return bool(requests)

    def _abort(self, requests: list[Request]) -> None:
        with deferred_interrupts():
            for request in requests:
                self._end(request, "abort")
                self._forget(request)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has more to return: requests not finished (with n > 1, any child), or outputs
        not yet delivered."""
        return bool(self._undelivered) or self.scheduler.has_unfinished_requests()

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], str | None, SamplingParams]:
        """Check one prompt and its parameters completely; nothing is queued here."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Sampling parameters must be a SamplingParams, got {params!r}.")
        # A checked copy: fields may have been changed since the object was made, and the caller
        # may change them again while the request runs.
        params = replace(params)
        token_ids = check_prompt(prompt, self.tokenizer, self.config.model_config.model, self.model_config.vocab_size)
        self.scheduler.check_request(len(token_ids), params.max_tokens)
        check_vocabulary(params, self.model_config.vocab_size)
        return token_ids, prompt if isinstance(prompt, str) else None, params

    def _add(self, token_ids: list[int], text: str | None, params: SamplingParams, request_id: str | None) -> str:
        """Queue a checked prompt as one request, or with n > 1 as n children; returns the caller's id."""
        n = params.n
        if request_id is None:  # the arrival number, unless a caller took it (then with a suffix)
            request_id = str(self._num_added)
            while self._in_use(request_id, n):
                request_id += "+"
        requests = []
        for index in range(n):
            # An unseeded request draws from a seed hashed from the engine's seed and its arrival number
            # (each child has its own): two identical requests differ, and the same engine run gives the
            # same tokens again.
            number = self._num_added + index
            p = params if n == 1 else child_params(params, index)
            seed = p.seed if p.seed is not None else derive_seed(self.config.model_config.seed, number)
            request = Request(
                request_id if n == 1 else child_request_id(request_id, index),
                token_ids,
                p,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
                sampling_seed=seed,
                parent_id=None if n == 1 else request_id,
                index=index,
                prompt_logprobs=[None] if p.prompt_logprobs is not None else [],
            )
            request.row_sampling = row_sampling_params(request, self.model_config.vocab_size)
            requests.append(request)
        with deferred_interrupts():  # in both books or in neither; a number is used only once it is in them
            for request in requests:
                self.scheduler.add_request(request)
                self._requests[request.request_id] = request
            if n > 1:
                self._parents[request_id] = ParentRequest(request_id, requests)
            self._num_added += n
        return request_id

    def _end(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        """Finish an unfinished request early ("abort", "error"): out of the scheduler, blocks freed."""
        self.scheduler.finish_request(request, reason, error)

    def _forget(self, request: Request) -> None:
        """Drop a finished request's record (the sampler keeps nothing per request), and its parent's
        once no child of it is left."""
        self._requests.pop(request.request_id, None)
        parent = self._parents.get(request.parent_id) if request.parent_id is not None else None
        if parent is not None and parent.forget(request):
            del self._parents[parent.request_id]

    # ---- stepping --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; a `RequestOutput` per request that got a token (or failed) in it.

        Outputs are cumulative (all tokens and text so far) with `finished` set on a request's
        last one, after which the engine forgets the request. With nothing to do, returns []. A prompt
        with n > 1 streams one output per child under the prompt's id (`outputs[0].index` says which),
        `finished` on the last one of the last child; `generate` returns its n completions together.

        Async scheduling (`async_scheduling`, on by default on CUDA): before this call waits for
        its step's tokens, it plans and launches the next step, so that the GPU never waits for
        the host (see pagedkv/engine/scheduler.py). Each call still returns one step's outputs,
        the same as without it; only a request that stops on an end-of-sequence token gets one
        wasted decode, whose token is dropped.

        Interrupts: a step interrupted before its tokens are sampled (Ctrl-C, any
        `BaseException`, at any point of the forward or the sampler) did not happen: its plan is
        undone (`Scheduler.undo`), and the next call runs the same step again. Once sampled, the
        step's bookkeeping runs to its end (a Ctrl-C then arrives right after it, see
        pagedkv/interrupts.py) and its outputs wait in the engine until the next call returns them.

        Failures: a request whose sampling raises is finished with finish_reason "error" (the
        reason in `RequestOutput.error`) while the others go on. When the model forward itself
        raises an `Exception`, no single request can be blamed (they share the batch), and
        retrying would most likely raise again; vLLM's engine core shuts down in that case. Here
        the step's requests are finished with an error and their blocks freed, then the exception
        is re-raised with a note naming them: the error is not hidden, and the engine serves later
        requests. A step listener that raises does so after its step had run: the next call returns
        that step's outputs.

        Exceptions in the engine's own bookkeeping (a `MemoryError`, a bug) never lose a request, a
        token or a block, and leave the engine callable:

        - Planning (`Scheduler.schedule`) raising part-way takes its plan back, as an interrupted
          step's: the exception goes on (noted as such), no request was changed, and the next call
          plans the same step again (`generate` aborts its requests, as on any exception).
        - Booking a sampled step is per request: an `Exception` raised while booking one (in
          `Scheduler.update`, the n-gram proposer, the detokenizer) finishes that request alone with
          finish_reason "error" and the reason in `RequestOutput.error`, its blocks freed and the
          tokens booked before the failure in its output; the step's other outputs are returned as
          usual. (Half booked, a request could never be planned again; re-raising would drop the
          others' tokens, whose step has run, or book them twice on a retry.) A batched text decode
          that raises is retried one request at a time, so only a request whose own text fails ends.
        - Whatever raises after the step's outputs are made (counters, a listener) leaves them in
          the engine: the next call returns them first.
        """
        return self._step(stream=True)

    def _step(self, stream: bool) -> list[RequestOutput]:
        """One step booked; `stream`: outputs of every request in it (else of the finished only,
        which is all `generate()` reads: text is made only for outputs a caller sees)."""
        with self._lock, phase_range("step"):
            return self._locked_step(stream)

    def _locked_step(self, stream: bool) -> list[RequestOutput]:
        # Steps launched for requests that all finished meanwhile (or that sample none: prompt chunks):
        # nothing in them to book but the prompt logprobs they computed.
        while self._launched and all(r.status is RequestStatus.FINISHED for r in self._launched[0].requests):
            with deferred_interrupts():
                self._book_prompt_logprobs(self._launched.popleft())
        if not self.scheduler.has_unfinished_requests():
            outputs, self._undelivered = self._undelivered, []
            return outputs
        # Listeners read the runner's state as their step left it: with any, one step at a time.
        depth = 2 if self.async_scheduling and not self._listeners else 1
        while len(self._launched) < depth and self._launch():
            pass
        if not self._launched:
            raise RuntimeError("Nothing could be scheduled although requests are unfinished (an engine bug).")
        step = self._launched[0]
        # Waits for the GPU (if it is still at it); an interrupt here leaves the step for the next call.
        with phase_range("wait", step.number):
            rows = step.sampled.rows([r.request_id for r in step.requests], [r.sampling_params for r in step.requests])
        with deferred_interrupts(), phase_range("book", step.number):
            self._launched.popleft()
            outputs = self._book(step, rows, stream)  # in self._undelivered from the moment they exist
        if self._listeners:
            event = StepEvent(
                step=self.stats.num_steps,
                scheduler_output=step.sched,
                result=step.result,
                block_ids={s.request.request_id: s.block_ids for s in step.sched.scheduled},
                num_free_blocks=[p.num_free_blocks for p in self.kv_cache_manager.block_pools],
                finished_req_ids=[r.request_id for r in outputs if r.finished],
                runner=self.runner,
            )
            try:
                for listener in list(self._listeners):
                    listener(event)
            except BaseException as error:
                error.add_note(
                    "pagedkv: a step listener raised after its step had run; the step's outputs are kept "
                    "and the next step() returns them first."
                )
                raise
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _launch(self) -> bool:
        """Plan a step and launch its forward and sampling (on a GPU they run on while the host
        goes on); False when there is nothing to plan. Undone if it raises or is interrupted."""
        sched: SchedulerOutput | None = None
        launched = False  # a Ctrl-C held back during the launch's bookkeeping is raised after it
        number = self._num_launched
        try:
            with deferred_interrupts(), phase_range("schedule", number):
                sched = self.scheduler.schedule()
                self.stats.num_preemptions += len(sched.preempted_req_ids)
            if not sched.scheduled:
                return False
            start = time.perf_counter()
            previous = self._launched[-1].sampled_tokens if self._launched else None
            scheduled = sched.runner_input()
            result = (self._executor or self.runner).execute_model(scheduled, previous, sched.freed_req_ids)
            requests = [self._requests[r] for r in result.batch.sampling_req_ids]
            req_ids = [r.request_id for r in requests]
            drafts = {s.request.request_id: len(s.draft_token_ids) for s in sched.scheduled}
            num_drafts = [drafts[r] for r in req_ids]
            # Per logits row, its request's parameters and seed and the position it draws: gathered by
            # the runner from its request rows (a request's 1 + k rows share its row).
            meta = result.sampling_metadata
            assert meta is not None
            with phase_range("sample", number):
                if any(num_drafts):  # one target row per draft and one after them: verify, then sample
                    assert result.draft_token_ids is not None
                    sampled = self.rejection_sampler(result.logits, meta, num_drafts, result.draft_token_ids)
                else:
                    sampled = self.sampler(result.logits, meta)
                prompt_logprobs = self._prompt_logprobs(scheduled, result.prompt_logits)
            with deferred_interrupts():
                self.scheduler.commit(sched)
                self._launched.append(
                    _LaunchedStep(
                        sched,
                        result,
                        requests,
                        sampled.to_host(),
                        SampledTokens(req_ids, sampled.last_token_ids()),
                        start,
                        number,
                        prompt_logprobs,
                    )
                )
                self._num_launched += 1
                sched, launched = None, True  # launched: from here on it has happened
            return True
        except BaseException as error:
            if sched is not None:
                with deferred_interrupts():
                    self.scheduler.undo(sched)
                    if isinstance(error, Exception):
                        self._fail_step(sched, error)
            elif not launched:  # Scheduler.schedule raised: it took its plan back itself
                error.add_note(
                    "pagedkv: planning the step raised; the plan was taken back (no request lost, no block "
                    "cached unwritten), and the next step() plans it again."
                )
            raise

    def _prompt_logprobs(
        self, scheduled: list[ScheduledTokens], logits: torch.Tensor | None
    ) -> tuple[list[tuple[Request, int, int]], SamplerOutput] | None:
        """The step's prompt logprobs, on their way to the host: per prompt position asked for, the
        log-probability of the prompt token after it and of the N most likely tokens there, as the
        sampler computes its logprobs (float32, of the model's raw distribution: `with_logprobs`)."""
        if logits is None:
            return None
        spans = [(self._requests[s.req_id], s.num_computed_tokens, s.num_prompt_logits) for s in scheduled]
        spans = [span for span in spans if span[2]]
        targets = [t for request, first, n in spans for t in request.prompt_token_ids[first + 1 : first + 1 + n]]
        most = max(request.sampling_params.prompt_logprobs or 0 for request, _, _ in spans)
        next_tokens = to_device(targets, logits.device, torch.int64)
        output = SamplerOutput(next_tokens, torch.zeros_like(next_tokens, dtype=torch.bool))
        return spans, with_logprobs(output, logits.float(), most, self.sampler.batch_invariant).to_host()

    @staticmethod
    def _book_prompt_logprobs(step: _LaunchedStep) -> None:
        """Append a step's prompt logprobs to its requests': only positions they have none for yet (a
        preempted request computes its prompt again)."""
        if step.prompt_logprobs is None:
            return
        spans, output = step.prompt_logprobs
        if output.ready is not None:
            output.ready.synchronize()
        assert output.logprob_token_ids is not None and output.logprobs is not None
        ids, logprobs = output.logprob_token_ids.tolist(), output.logprobs.tolist()
        row = 0
        for request, first, n in spans:
            width = 1 + (request.sampling_params.prompt_logprobs or 0)
            for position in range(first, first + n):
                if position + 1 == len(request.prompt_logprobs):  # the entry of the token after it
                    request.prompt_logprobs.append(dict(zip(ids[row][:width], logprobs[row][:width])))
                row += 1

    def _book(
        self,
        step: _LaunchedStep,
        rows: list[tuple[list[int] | Exception, list[dict[int, float]] | None]],
        stream: bool,
    ) -> list[RequestOutput]:
        """Book a launched step's samples: tokens appended (with drafts: the accepted ones and the
        target's next), stops checked, failed samples finished, the next drafts proposed; its
        outputs, added to `_undelivered` as soon as they are made. Requests finished meanwhile
        (aborted, or stopped a step before) are skipped.

        Each request is booked on its own (see `step`): an `Exception` while booking one, in
        `Scheduler.update`, the n-gram proposer or the making of its text, finishes that request
        alone with finish_reason "error". What comes after the outputs (the drafts' ids for the
        trace, the counters) concerns no request: if it raises, the outputs are kept for the next
        call."""
        self._book_prompt_logprobs(step)
        live = [(r, row) for r, row in zip(step.requests, rows) if r.status is not RequestStatus.FINISHED]
        self.scheduler.update(step.sched, {r.request_id: t for r, (t, _) in live if not isinstance(t, Exception)})
        for request, (tokens, logprobs) in live:
            if isinstance(tokens, Exception):  # this request's failure alone: the others go on
                self._end(request, "error", tokens)
                continue
            try:
                if logprobs is not None:  # one per token kept (a stop drops the ones after it)
                    request.output_logprobs += logprobs[: len(request.output_token_ids) - len(request.output_logprobs)]
                if request.status is RequestStatus.RUNNING and self.speculative_config is not None:
                    request.spec_token_ids = self._propose(request)
            except Exception as error:  # its tokens are booked; without its next drafts it ends here
                logger.warning("Request %s failed while its step was booked: %r", request.request_id, error)
                self._end(request, "error", error)
        booked = [r for r, _ in live]
        # Text only for the outputs a caller reads (streamed ones, or generate()'s finished ones), and for
        # requests with `stop` strings, searched in their new text every step (vllm/v1/engine/detokenizer.py).
        watched = [r for r in booked if r.sampling_params.stop and r.finish_reason in (None, "length")]
        texts = dict(zip([r.request_id for r in watched], self._texts(watched))) if watched else {}
        for request in watched:
            if request.finish_reason in (None, "length") and request.check_stop_strings(texts[request.request_id]):
                if request.status is not RequestStatus.FINISHED:
                    self._end(request, "stop")
        shown = booked if stream else [r for r in booked if r.status is RequestStatus.FINISHED]
        unread = [r for r in shown if r.request_id not in texts]
        texts.update(zip([r.request_id for r in unread], self._texts(unread)))
        outputs = [self._streamed(r, r.output(texts[r.request_id])) for r in shown]
        self._undelivered += outputs
        finished = [r for r in booked if r.status is RequestStatus.FINISHED]
        for request in finished:
            self._forget(request)
        try:
            self._read_drafts(step)
            self.stats.model_time_s += time.perf_counter() - step.start
            self.stats.count_step(step.sched, step.result.cudagraph_mode.name, len(finished))
        except Exception as error:
            error.add_note(
                "pagedkv: the step's bookkeeping raised after its tokens were booked; its outputs are kept "
                "and the next step() returns them first."
            )
            raise
        return outputs

    def _propose(self, request: Request) -> list[int]:
        """Drafts for a request's next step: an n-gram lookup in its tokens, or placeholders the
        runner's draft model fills (it proposes on the device, right before the target verifies)."""
        spec = self.speculative_config
        assert spec is not None
        if self._ngram is not None:
            return self._ngram.propose(request.all_token_ids)
        return [PLACEHOLDER_TOKEN_ID] * spec.num_speculative_tokens

    @staticmethod
    def _read_drafts(step: _LaunchedStep) -> None:
        """Put the drafts a draft model proposed on the device into the step's plan (for traces)."""
        scheduled = [s for s in step.sched.scheduled if s.draft_token_ids]
        if not any(PLACEHOLDER_TOKEN_ID in s.draft_token_ids for s in scheduled):
            return
        assert step.result.draft_token_ids is not None
        ids = step.result.draft_token_ids.tolist()
        for s in scheduled:
            s.draft_token_ids, ids = ids[: len(s.draft_token_ids)], ids[len(s.draft_token_ids) :]

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> None:
        req_ids = [s.request.request_id for s in sched.scheduled]
        for s in sched.scheduled:
            self._end(s.request, "error", error)
            self._forget(s.request)
        # One story per failure: a dead tensor-parallel group says itself that nothing can run any more.
        later = "" if isinstance(error, EngineDeadError) else "; the engine can serve other requests"
        error.add_note(
            f"pagedkv: the model step failed, so its requests {req_ids} were finished with an error "
            f"and their KV cache blocks freed{later}."
        )

    def _streamed(self, request: Request, output: RequestOutput) -> RequestOutput:
        """A request's output as step() streams it: a child's (n > 1) is finished only when its prompt is."""
        parent = self._parents.get(request.parent_id) if request.parent_id is not None else None
        return output if parent is None else parent.stream(output, request)

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The requests' outputs, their text brought up to date (`_texts`)."""
        return [request.output(text) for request, text in zip(requests, self._texts(requests))]

    def _texts(self, requests: list[Request]) -> list[str]:
        """The requests' output texts, brought up to date by one batched decode (made only where needed:
        outputs a caller reads, and requests with `stop` strings)."""
        texts = [""] * len(requests)
        if self.tokenizer is not None:
            items = []
            for r in requests:
                assert r.detokenizer is not None  # with a tokenizer, every request is given one when added
                items.append((r.detokenizer, r.output_token_ids))
            try:
                texts = detokenize_batch(self.tokenizer, items)
            except Exception:  # whose text raised is not known: each on its own (a detokenizer that
                texts = [self._text(r) for r in requests]  # settled in the batch gives the same text again)
        return texts

    def _text(self, request: Request) -> str:
        """One request's text; if it cannot be made, the request ends with an error (its tokens are
        in its output all the same) rather than stream text that no longer follows its tokens."""
        assert self.tokenizer is not None and request.detokenizer is not None
        try:
            return detokenize_batch(self.tokenizer, [(request.detokenizer, request.output_token_ids)])[0]
        except Exception as error:
            logger.warning("The text of request %s could not be made: %r", request.request_id, error)
            if request.status is RequestStatus.FINISHED:  # its blocks are freed already: only say why
                request.finish_reason, request.error = "error", f"{type(error).__name__}: {error}"
            else:
                self._end(request, "error", error)
            return ""

    # ---- offline batch ---------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in prompt order.

        All or nothing: every prompt is checked before any is queued, and if the run is
        interrupted (an exception in a step listener, Ctrl-C) this call's requests are aborted
        before the exception goes on. A request that fails on its own is returned with
        finish_reason "error". The engine must be idle: requests queued with `add_request`
        are driven with `step()` (or aborted) first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}.")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):  # its items are checked with their prompts
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                f"got {sampling_params!r}."
            )
        use_tqdm = check_optional_bool("use_tqdm", use_tqdm, hint=" (None: a bar from 8 prompts on)")
        show_progress = use_tqdm if use_tqdm is not None else len(prompts) >= 8
        if len(sampling_params) != len(prompts):
            raise ValueError(f"Got {len(prompts)} prompts but {len(sampling_params)} sampling params.")
        if self.has_unfinished_requests():
            raise ValueError(
                f"generate() needs an idle engine, but {len(self._requests)} request(s) added with add_request are "
                f"unfinished and {len(self._undelivered)} output(s) of a step whose listener raised are not yet "
                "returned: call step() until has_unfinished_requests() is False, or abort_request() them."
            )
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                prepared.append(self._prepare(prompt, params))
            except (TypeError, ValueError) as e:  # re-raised as the base type: a subclass may need other arguments
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"prompt {i}: {e} (nothing was queued)"
                ) from None
        per_prompt: list[tuple[str, list[Request]]] = []  # each prompt's id and its requests (n of them)
        try:
            for p in prepared:
                request_id = self._add(*p, None)
                parent = self._parents.get(request_id)
                per_prompt.append((request_id, parent.children if parent else [self._requests[request_id]]))
            requests = [r for _, rs in per_prompt for r in rs]
            with tqdm(total=len(requests), desc="generate", unit="req", disable=not show_progress) as bar:
                while self.has_unfinished_requests():
                    bar.update(len(self._step(stream=False)))
        except BaseException:
            with deferred_interrupts():  # a second Ctrl-C must not stop the clean-up half way
                self._abort([r for _, rs in per_prompt for r in rs if r.request_id in self._requests])
                self._undelivered.clear()  # this call's (the engine was idle): it returns none of them
            raise
        # The Request objects hold the final state, also of one aborted meanwhile (by a listener, say).
        outputs = iter(self._outputs(requests))
        return [merge_outputs(request_id, [next(outputs) for _ in rs]) for request_id, rs in per_prompt]


# help(LLM) lists every argument with its default and docstring, made from EngineArgs (so never stale).
LLM.__doc__ = f"{(LLM.__doc__ or '').rstrip()}\n\n{textwrap.indent(engine_args_doc(), '    ')}\n"
