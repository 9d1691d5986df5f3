"""Exercises of notebook 09 (serving end to end): predict what the scheduler does next.

    show_queue_state(llm)                       what the student may look at
    check_next_schedule(llm, tokens, preempted) tokens per request of the next step, and who is preempted

The answer is recomputed by running `schedule()` on a deep copy of the engine's scheduler
(and its KV cache manager), so the engine itself is not advanced by checking.
"""

from __future__ import annotations

import copy

from pagedkv.engine.llm import LLM
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.exercises import CheckResult


def show_queue_state(llm: LLM) -> str:
    """Budget, free blocks, the running list (oldest first) and the waiting queue (front first)."""
    sched, manager = llm.scheduler, llm.kv_cache_manager
    bs = manager.specs[0].block_size

    def line(req: Request) -> str:
        rows = manager.get_block_ids(req.request_id)
        left = req.num_tokens - req.num_computed_tokens
        return (
            f"  request {req.request_id}: {req.num_tokens} tokens, {req.num_computed_tokens} in the cache "
            f"({left} to compute), holds {len(rows[0]) if rows else 0} blocks"
        )

    return "\n".join([
        f"token budget per step: {sched.config.max_num_batched_tokens}, block_size: {bs}, "
        f"free blocks: {manager.num_free_blocks()}",
        "running (oldest first):", *map(line, sched.running),
        "waiting (front first):", *map(line, sched.waiting),
    ])


def _plan(llm: LLM) -> SchedulerOutput:
    return copy.deepcopy(llm.scheduler).schedule()


def _why(llm: LLM, plan: SchedulerOutput, req_id: str) -> str:
    """The scheduler's rule that decided `req_id`'s share of the next step."""
    scheduler = llm.scheduler
    given = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    budget = scheduler.config.max_num_batched_tokens  # what is left when the request's turn comes
    for req in [*scheduler.running, *scheduler.waiting]:  # the order `schedule()` visits them
        if req.request_id != req_id:
            budget -= given.get(req.request_id, 0)
            continue
        n, left = given.get(req_id, 0), req.num_tokens - req.num_computed_tokens
        if req_id in plan.preempted_req_ids:
            return (f"request {req_id} is preempted: a running request needed a new block and none was free, "
                    "so the newest running request gives all its blocks back.")
        if n == 0 and plan.preempted_req_ids and req in scheduler.waiting:
            return f"request {req_id} waits: no new request is admitted in a step that had to preempt."
        if n == 0 and budget <= 0:
            return (f"request {req_id} gets nothing: the token budget is used up by the requests before it "
                    "(running ones first, oldest first).")
        if n == 0:
            return (f"request {req_id} is not admitted: the free blocks do not cover its next chunk (or "
                    "max_num_seqs is reached); the waiting queue stops at the first request that does not fit.")
        if left == 1 and req.output_token_ids:
            return f"request {req_id} is decoding: it computes exactly its one newest token."
        if n == left:
            return f"request {req_id} has {left} tokens left and {budget} tokens of budget at its turn: all fit."
        return (f"request {req_id} has {left} tokens left but only {budget} tokens of budget remain at its turn: "
                f"its prefill is chunked, {n} now and the rest in later steps.")
    return f"request {req_id} is neither running nor waiting in this engine."


def check_next_schedule(llm: LLM, tokens: object, preempted: object = ()) -> CheckResult:
    """`tokens`: {request id: tokens it computes in the next step}; `preempted`: ids preempted in it."""
    plan = _plan(llm)
    expected = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    if tokens is ... or tokens is None:
        return CheckResult(False, "Replace `...` with a dict {request id: number of tokens} for the next step.")
    if not isinstance(tokens, dict):
        return CheckResult(False, f"tokens must be a dict such as {{'0': 1, '3': 12}}, got {type(tokens).__name__}.")
    if preempted is ...:
        return CheckResult(False, "Replace the `...` of `preempted` with a list of request ids ([] if none).")
    if not isinstance(preempted, (list, tuple)):
        return CheckResult(False, f"preempted must be a list such as ['2'] or [], got {type(preempted).__name__}.")
    got = {str(k): v for k, v in tokens.items() if v}  # a request with 0 tokens may be left out
    for rid in sorted(set(expected) | set(got), key=lambda r: (len(r), r)):
        if got.get(rid, 0) != expected.get(rid, 0):
            return CheckResult(False, (
                f"request {rid}: expected {expected.get(rid, 0)} token(s), you wrote {got.get(rid, 0)}. "
                + _why(llm, plan, rid)
            ))
    want_preempted = sorted(plan.preempted_req_ids)
    if sorted(str(p) for p in preempted) != want_preempted:
        victims = ", ".join(want_preempted) or "none"
        reason = (
            " " + _why(llm, plan, want_preempted[0]) if want_preempted
            else " Every running request found the blocks it needs."
        )
        return CheckResult(False, f"preempted: expected {victims}, you wrote {sorted(preempted)}.{reason}")
    total = sum(expected.values())
    return CheckResult(True, f"next step: {expected} ({total} tokens), preempted: {want_preempted or 'none'}. Correct.")
