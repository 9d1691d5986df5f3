"""Continuous batching: which requests run this step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running requests go first,
oldest first; then waiting ones are admitted while budget, `max_num_seqs` and KV blocks
last. A prompt that does not fit the budget is split over steps (chunked prefill):

    step 1: [A decode][B decode][C prompt 0:510        ]   budget 512
    step 2: [A decode][B decode][C prompt 510:700][D ..]

When a running request needs a block and none is free, the newest running request is
preempted: its blocks are freed and it goes back to the *front* of the waiting queue
with `num_computed_tokens = 0`, to be recomputed later. Nothing is ever dropped.

With prefix caching, a request admitted from the waiting queue (new, or resumed after
preemption) first takes the longest cached prefix of its tokens: it starts with
num_computed_tokens at that length, and the budget pays only for the rest.

A plan is not a fact until its step has run. `commit` makes it one once the step's forward and
sampling are launched (tokens computed, blocks' hashes kept); `undo` takes it back when they raised
or were interrupted (Ctrl-C): the requests it admitted return to the front of the waiting queue
holding no blocks, and the next `schedule` plans the same step again. A `schedule` that raises
part-way (a `MemoryError`) takes back what it did the same way before the exception goes on. `update`
then books the sampled tokens (stop checks, finished requests freed), each request on its own: one
whose booking raises is finished with an error, the others are booked.

Async scheduling (vLLM's `async_scheduling`) plans step N+1 before the host has read the tokens
step N sampled. Those tokens are placeholders (`Request.num_output_placeholders`): step N+1
computes them all the same (the runner takes their ids from the device), and the stop checks see
them a step late. A request whose length limits end it in step N is not planned again; one that
stops on an end-of-sequence token gets one wasted decode, whose token is dropped:

    host:  plan 1 | plan 2 | book 1 | plan 3 | book 2 | plan 4 | book 3 ...
    GPU:          | step 1 ......... | step 2 ......... | step 3 .........

Speculative decoding (vLLM's spec decode, vllm/v1/core/sched/scheduler.py): a decoding request with
drafts (`Request.spec_token_ids`) runs its last token and k drafts in one step, 1 + k query tokens
the budget pays for. `update` books the accepted drafts and the target's next token, and rolls the
rest back: num_computed_tokens drops by the rejected drafts (their KV slots are written again next
step) and blocks that held only rejected drafts go back to the pool (`KVCacheManager.trim`):

    step:   [t d1 d2 d3]  positions 40..43, drafts d1 d2 accepted, d3 rejected, target token x
    after:  tokens ... t d1 d2 x   num_computed_tokens 43 (x is computed next step), slot of 43 reused
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pagedkv.config import SchedulerConfig
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv_cache.block_pool import KVCacheBlock
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, ScheduledTokens

logger = logging.getLogger("pagedkv")


@dataclass
class ScheduledRequest:
    """One request's share of a step, as planned: a snapshot that `Scheduler.update` does not change."""

    request: Request
    num_new_tokens: int
    """Query length this step: positions num_computed_tokens ... + num_new_tokens - 1."""
    num_computed_tokens: int = field(init=False)
    """Tokens already in the KV cache when the step was planned (its context_len)."""
    samples: bool = field(init=False)
    """The step computes the request's last known token, so a new one is sampled."""
    is_decode: bool = field(init=False)
    """One new token right after a sampled one (vLLM's decode)."""
    num_cached_tokens: int = 0
    """Tokens found in the prefix cache when the request was admitted in this step (the first
    num_cached_tokens of its context: not computed)."""
    num_lookup_tokens: int = 0
    """Tokens looked up in the prefix cache: all of them when admitted in this step holding no
    blocks (new or resumed; with caching off the lookup finds nothing), else 0."""
    admitted_from: RequestStatus | None = None
    """The status it was admitted from in this step (WAITING or PREEMPTED); None if it was running."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, its block table row once the step is planned (a copy: later steps'
    allocations do not change it). Filled by `Scheduler.schedule`."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the drafts verified in this step, after the request's last token (the
    last len(draft_token_ids) of its num_new_tokens); -1 until a draft model's proposals are read."""
    num_accepted_tokens: int | None = None
    """Drafts accepted, once the step is booked (None without drafts)."""
    rolled_back_block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the blocks given back at booking because they held only rejected drafts."""

    def __post_init__(self) -> None:
        self.num_computed_tokens = self.request.num_computed_tokens
        known = self.num_new_tokens - len(self.draft_token_ids)
        self.samples = self.num_computed_tokens + known == self.request.num_tokens_with_placeholders
        # Its one known query token is an output token (its id may still be a placeholder).
        self.is_decode = known == 1 and self.samples and self.num_computed_tokens >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    """The plan of one step, decodes first."""

    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[str]
    freed_req_ids: list[str] = field(default_factory=list)
    """Requests whose blocks were freed since the last step planned (finished, aborted, preempted,
    admissions taken back): the runner gives their rows back before it runs this one."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens

    def runner_input(self) -> list[ScheduledTokens]:
        """The plan as the model runner takes it: per request, the new token ids after the cached
        ones; a token the host has not read yet is PLACEHOLDER_TOKEN_ID (the runner fills it in)."""
        scheduled = []
        for s in self.scheduled:
            known = s.num_new_tokens - len(s.draft_token_ids)
            token_ids = s.request.token_ids_between(s.num_computed_tokens, s.num_computed_tokens + known)
            token_ids += [PLACEHOLDER_TOKEN_ID] * (known - len(token_ids)) + s.draft_token_ids
            num_prompt_logits = 0
            if s.request.sampling_params.prompt_logprobs is not None:  # positions whose next token is a prompt token
                last = min(s.num_computed_tokens + known, s.request.num_prompt_tokens - 1)
                num_prompt_logits = max(last - s.num_computed_tokens, 0)
            scheduled.append(
                ScheduledTokens(
                    s.request.request_id,
                    token_ids,
                    s.num_computed_tokens,
                    s.samples,
                    s.block_ids,
                    num_draft_tokens=len(s.draft_token_ids),
                    sampling=s.request.row_sampling,
                    num_prompt_logits=num_prompt_logits,
                )
            )
        return scheduled


class Scheduler:
    """Waiting queue + running list over a KV cache manager."""

    def __init__(self, config: SchedulerConfig, max_model_len: int, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.freed_req_ids: list[str] = []
        """Freed since the last plan with something scheduled (`SchedulerOutput.freed_req_ids`)."""

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if such a request could never run, so it is refused before it is queued."""
        if num_prompt_tokens == 0:
            raise ValueError("The prompt is empty.")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"A prompt of {num_prompt_tokens} tokens does not fit "
                f"max_model_len={self.max_model_len} (it must leave room for at least one new token). "
                "Shorten the prompt or raise max_model_len."
            )
        longest = min(num_prompt_tokens + max_tokens, self.max_model_len)
        needed = self.kv_cache_manager.blocks_for_tokens(longest)
        available = self.kv_cache_manager.num_usable_blocks
        if needed > available:
            raise ValueError(
                f"{longest} tokens (prompt + max_tokens) need {needed} KV cache "
                f"blocks, but the cache has only {available}. Use num_kv_blocks >= {needed + 1}, a larger "
                "KV cache memory budget, or a smaller max_tokens."
            )

    def add_request(self, request: Request) -> None:
        self.check_request(request.num_prompt_tokens, request.sampling_params.max_tokens)
        self.waiting.append(request)

    def finish_request(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        """End a waiting or running request ("stop", "length", "abort", "error"): out of the queues, blocks
        freed; `error` (with "error") is why, kept in `Request.error` for its output."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if error is not None:
            request.error = f"{type(error).__name__}: {error}"

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, request_id: str) -> None:
        """A request's blocks back to the pool; the runner is told with the next plan."""
        self.kv_cache_manager.free(request_id)
        self.freed_req_ids.append(request_id)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. If planning raises part-way (a `MemoryError` in `allocate_slots`, say,
        after an earlier admission of the same plan hashed the blocks it is to fill), what it did is
        taken back as `undo` takes back a plan never launched, and the exception goes on: no pending
        hash outlives it (the next plan's commit would make those blocks findable with K/V never
        written), every admitted request is back at the front of the waiting queue holding no
        blocks. Preemptions stay done; running requests keep blocks added for them (both consistent)."""
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        admitting: list[tuple[Request, RequestStatus]] = []  # the one on its way in, until it is in `scheduled`
        try:
            self._plan(scheduled, preempted, admitting)
        except BaseException:
            # The one half admitted first, then the others in front of it: the queue's order is kept.
            for request, status in admitting:
                self._take_back(request, status)
            self.undo(SchedulerOutput(scheduled, preempted))
            raise
        output = SchedulerOutput(scheduled, preempted)
        if scheduled:  # a plan that runs nothing tells the runner nothing: they wait for the next one
            output.freed_req_ids, self.freed_req_ids = self.freed_req_ids, []
        return output

    def _plan(
        self,
        scheduled: list[ScheduledRequest],
        preempted: list[str],
        admitting: list[tuple[Request, RequestStatus]],
    ) -> None:
        """`schedule`'s body: fills `scheduled` and `preempted` as it goes, so that a plan that raises
        part-way can be taken back; `admitting` holds the waiting request between its first change
        and its entry in `scheduled`."""
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget)
            if request.num_output_placeholders and request.surely_finished(self.max_model_len):
                i += 1  # its step in flight is its last
                continue
            drafts = self._drafts(request, budget) if n == 1 else []
            n += len(drafts)
            preempted_itself = False
            while not kv.allocate_slots(
                request.request_id, request.num_computed_tokens, n, token_ids=request.all_token_ids
            ):
                victim = self.running[-1]
                self._preempt(victim)
                self.running.pop()
                preempted.append(victim.request_id)
                if victim is request:
                    preempted_itself = True
                    break
            if preempted_itself:
                break
            scheduled.append(ScheduledRequest(request, n, draft_token_ids=drafts))
            budget -= n
            i += 1

        # 2. Waiting requests, front first -- but not in a step that had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted with a token in flight: admitted once it is read
                break
            hits: list[list[KVCacheBlock]] = []
            num_hit = 0
            admitting.append((request, request.status))
            # New or preempted: holds no blocks. One that asked for prompt logprobs computes every prompt
            # position, so it reads no cached prefix (as vllm/v1/core/kv_cache_manager.py get_computed_blocks).
            looks_up = request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None
            if looks_up:
                hits, num_hit = kv.get_computed_blocks(request.request_id, request.all_token_ids)
            n = request.num_tokens - request.num_computed_tokens - num_hit
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    admitting.clear()
                    break
                n = budget
            if not kv.allocate_slots(
                request.request_id, request.num_computed_tokens + num_hit, n, hits, token_ids=request.all_token_ids
            ):
                admitting.clear()
                break
            looked_up = request.num_tokens if looks_up else 0
            request.num_computed_tokens += num_hit
            admitted = ScheduledRequest(
                request, n, num_cached_tokens=num_hit, num_lookup_tokens=looked_up, admitted_from=request.status
            )
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(admitted)  # last: from here on `undo` takes it back
            admitting.clear()
            budget -= n

        # Decodes first, one-token ones before those with drafts: kernels (and MLA) split the batch
        # at the leading requests of one query token.
        scheduled.sort(key=lambda s: (not s.is_decode, s.is_decode and s.num_new_tokens > 1))
        for s in scheduled:  # the rows the step reads, once every allocation of the plan is made
            s.block_ids = kv.get_block_ids(s.request.request_id)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: its proposals, as many as the token budget
        and its limits leave useful (the step emits at most drafts + 1 tokens)."""
        if not request.spec_token_ids or request.num_computed_tokens < request.num_prompt_tokens:
            return []
        room = min(
            budget - 1,
            request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return request.spec_token_ids[: max(room, 0)]

    def _preempt(self, request: Request) -> None:
        """Back to the front of the waiting queue first, its blocks freed after: if freeing raises,
        the request is still in a queue (and `schedule`'s rollback finds it there)."""
        self.waiting.appendleft(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._free(request.request_id)

    def commit(self, output: SchedulerOutput) -> None:
        """The step is launched (its forward and sampling): its tokens count as computed, the
        hashes its plan gave blocks are kept, and each sampled token is a placeholder until `update`."""
        self.kv_cache_manager.commit()
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.num_lookup_tokens:
                s.request.num_cached_tokens = s.num_cached_tokens
            s.request.num_output_placeholders += s.samples

    def undo(self, output: SchedulerOutput) -> None:
        """Take back the plan of a step that was not launched: the hashes it gave blocks, and its
        admissions (in reverse, so the waiting queue is as it was). Running requests keep the
        blocks it added, which the same step planned again needs; preemptions stay done."""
        self.kv_cache_manager.rollback()
        self.freed_req_ids[:0] = output.freed_req_ids  # the runner was not told (or is told again: harmless)
        for s in reversed(output.scheduled):
            if s.admitted_from is not None:
                self._take_back(s.request, s.admitted_from)

    def _take_back(self, request: Request, status: RequestStatus) -> None:
        """Return a request admitted by a plan that did not run to the front of the waiting queue,
        holding no blocks (it held none before). It may be anywhere on its way in (a plan that raised
        part-way): still first in the waiting queue, or popped, or running."""
        if request in self.running:
            self.running.remove(request)
        self._free(request.request_id)
        request.num_computed_tokens = 0
        request.status = status
        if not (self.waiting and self.waiting[0] is request):
            self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Book a committed step's sampled tokens (per request: its accepted drafts, then the target's
        token): append them, roll back rejected drafts, finish and free what stopped; returns the
        requests it finished.

        A request finished meanwhile (a step late, or aborted) drops its tokens; a request
        preempted meanwhile keeps them (the step computed them from the request's blocks of then).

        Each request is booked on its own: one whose booking raises an `Exception` is finished with
        finish_reason "error" (its blocks freed, the tokens appended before the failure kept), and
        the step's other requests are booked all the same. Left half booked, it could never be
        planned again (a placeholder that no step resolves), and raising would lose the others'
        tokens, whose step has run. (vLLM's engine core dies with such an exception,
        vllm/v1/engine/core.py; this engine lives on, so it must keep its books whole.)"""
        finished = []
        for s in output.scheduled:
            request = s.request
            if not s.samples or request.status is RequestStatus.FINISHED:
                continue
            try:
                if self._update_request(s, sampled.get(request.request_id)):
                    finished.append(request)
            except Exception as error:
                logger.warning("Request %s failed while its step was booked: %r", request.request_id, error)
                self.finish_request(request, "error", error)
                finished.append(request)
        return finished

    def _update_request(self, s: ScheduledRequest, tokens: list[int] | None) -> bool:
        """Book one request's share of a step (`update`); True when it finished."""
        request = s.request
        request.num_output_placeholders -= 1
        request.spec_token_ids = []  # proposed for this step; the engine proposes anew
        if tokens is None:  # its sampling failed: the engine ends it
            return False
        if s.draft_token_ids:
            s.num_accepted_tokens = len(tokens) - 1
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens -= len(s.draft_token_ids) - s.num_accepted_tokens
        for token in tokens:
            request.append_output_token_id(token)
            if request.check_stop(self.max_model_len):
                assert request.finish_reason is not None  # check_stop sets it when it stops the request
                self.finish_request(request, request.finish_reason)
                return True
        if s.draft_token_ids and request.status is RequestStatus.RUNNING:
            s.rolled_back_block_ids = self.kv_cache_manager.trim(request.request_id, request.num_tokens)
        return False
