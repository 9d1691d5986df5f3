"""Exercises of notebook 09 (serving end to end): predict what the scheduler does next.

    show_queue_state(llm)                       what the student may look at
    check_next_schedule(llm, tokens, preempted) tokens per request of the next step, and who is preempted

The answer is a value about the notebook's engine. Once it is read, the checker works out the
next step by running `schedule()` on a deep copy of the engine's scheduler (and its KV cache
manager), so the engine itself is not advanced by checking. A wrong answer is told which rule
of the scheduler decides the request it got wrong (budget, chunked prefill, decode, preemption),
with a hint, never the number; `reveal()` walks the step request by request.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pagedkv.engine.llm import LLM
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.exercises import CheckResult, Either, exercise, plain


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

    return "\n".join(
        [
            f"token budget per step: {sched.config.max_num_batched_tokens}, block_size: {bs}, "
            f"free blocks: {manager.num_free_blocks()}",
            "running (oldest first):",
            *map(line, sched.running),
            "waiting (front first):",
            *map(line, sched.waiting),
        ]
    )


def _turns(llm: LLM, plan: SchedulerOutput) -> list[tuple[Request, int, int]]:
    """(request, tokens it got, budget left at its turn) in the order `schedule()` visits them:
    running requests oldest first, then the waiting queue front first."""
    scheduler = llm.scheduler
    given = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    budget, turns = scheduler.config.max_num_batched_tokens, []
    for req in [*scheduler.running, *scheduler.waiting]:
        n = given.get(req.request_id, 0)
        turns.append((req, n, budget))
        budget -= n
    return turns


def _hint(llm: LLM, plan: SchedulerOutput, req: Request, n: int, budget: int, wrote: int) -> str:
    """The scheduler's rule that decided `req`'s share of the next step, as a hint that does not
    give the share (`wrote`: the student's number for it)."""
    left = req.num_tokens - req.num_computed_tokens
    waiting = req in llm.scheduler.waiting
    if req.request_id in plan.preempted_req_ids or (n == 0 and plan.preempted_req_ids and not waiting):
        return (
            "a running request needs a new block in this step and the pool has none free: which request "
            "gives its blocks back (rule 4), and what does that request compute in the step?"
        )
    if n == 0 and plan.preempted_req_ids and waiting:
        return "it waits in the queue: no new request is admitted in a step that had to preempt."
    if n == 0 and budget <= 0:
        return "the requests before it (running ones first, oldest first) use up the token budget before its turn."
    if n == 0:
        return (
            "the free blocks do not cover its next chunk (or max_num_seqs is reached): the waiting queue stops "
            "at the first request that does not fit."
        )
    if left == 1 and req.output_token_ids:
        return (
            "it is decoding: its prompt and earlier outputs are all in the cache, so a step computes only the "
            "token it sampled last."
        )
    if n == left:
        return (
            "the budget left at its turn covers everything it has left to compute (show_queue_state: "
            "'to compute'), so nothing of it waits for a later step."
        )
    if wrote >= left:
        return (
            f"it has more tokens left to compute than the budget left at its turn: subtract what the requests "
            f"before it take from the {llm.scheduler.config.max_num_batched_tokens} tokens; its prefill is "
            "chunked (rule 3)."
        )
    return (
        "its prefill is chunked (rule 3): it gets all of the budget the requests before it leave (running ones "
        "first, oldest first, each one token if decoding)."
    )


def _worked(llm: LLM, plan: SchedulerOutput) -> Callable[[], str]:
    """The next step worked out request by request (for `reveal`), from the engine's state now."""
    head = (
        f"token budget {llm.scheduler.config.max_num_batched_tokens}, {llm.kv_cache_manager.num_free_blocks()} "
        "free block(s); running requests oldest first, then the waiting queue front first:"
    )
    rows = []
    for req, n, budget in _turns(llm, plan):
        left = req.num_tokens - req.num_computed_tokens
        if req.request_id in plan.preempted_req_ids:
            what = "preempted (a running request found no free block; the newest running one gives its back)"
        else:
            what = f"{n} token(s)" + (", chunked" if 0 < n < left else "")
        state = "waiting" if req in llm.scheduler.waiting else "running"
        rows.append(
            f"  request {req.request_id} ({state}, {left} to compute, budget {max(budget, 0)} at its turn): " + what
        )
    tokens = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    result = f"= tokens {tokens}, preempted {sorted(plan.preempted_req_ids)}"
    return lambda: "\n".join([head, *rows, result])


@exercise("09: the scheduler's next step")
def check_next_schedule(llm: LLM, tokens: object, preempted: object = ()) -> CheckResult:
    """`tokens`: {request id: tokens it computes in the next step}; `preempted`: ids preempted in it."""
    request_id: Any = Either(("", 0))  # a str or an int id: plain gives whichever the answer used
    try:  # plain ints and strs from here on: an answer's own == takes no part in the comparisons
        plain_tokens = plain(tokens, {request_id: 0})
    except TypeError as error:
        return CheckResult(False, f"tokens must be a dict such as {{'0': 1, '3': 12}}: {error}.")
    try:
        plain_preempted = plain(preempted, [request_id])
    except TypeError as error:
        return CheckResult(False, f"preempted must be a list such as ['2'] or []: {error}.")
    try:
        counts = [(str(int(k)), v) for k, v in plain_tokens.items()]
        wrote = sorted(str(int(p)) for p in plain_preempted)
    except ValueError as exc:
        return CheckResult(False, f"Request ids are numbers such as '0' or 0, token counts ints: {exc}.")
    got = {rid: n for rid, n in counts if n}  # a request with 0 tokens may be left out
    known = {req.request_id for req in [*llm.scheduler.running, *llm.scheduler.waiting]}
    strangers = sorted(set(got) - known)
    if strangers:
        return CheckResult(
            False,
            f"request {strangers[0]} is neither running nor waiting in this engine "
            "(show_queue_state lists those that are).",
        )

    # Only now, with the answer read: the next step, planned on a copy of the scheduler.
    plan = copy.deepcopy(llm.scheduler).schedule()
    expected = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    work = _worked(llm, plan)
    for req, n, budget in _turns(llm, plan):
        rid = req.request_id
        if got.get(rid, 0) != n:
            return CheckResult(
                False,
                f"request {rid}: you wrote {got.get(rid, 0)} token(s), which is not it: "
                f"{_hint(llm, plan, req, n, budget, got.get(rid, 0))}",
                reveal=work,
            )
    if wrote != sorted(plan.preempted_req_ids):
        if not plan.preempted_req_ids:
            hint = (
                "every running request finds the blocks its tokens need (compare the slots each needs with the "
                "blocks it holds and the free ones), so nobody is preempted."
            )
        elif not wrote:
            hint = (
                "some running request needs a new block and the pool has none free: compare the slots each "
                "running request's tokens need with the blocks it holds (rule 4)."
            )
        else:
            hint = (
                "preemption takes the newest running request (the last admitted), until the request that "
                "needs a block gets one or is the victim itself."
            )
        return CheckResult(False, f"preempted: {wrote} is not it: {hint}", reveal=work)
    return CheckResult(
        True,
        f"next step: {expected} ({sum(expected.values())} tokens), preempted: "
        f"{sorted(plan.preempted_req_ids) or 'none'}. Correct.",
    )
