"""Exercises of notebook 02 (the paged KV cache). Answers are recomputed from a live engine.

show_cache_state(llm)                          what the student may look at
check_blocks_held(llm, req_id, num_blocks, num_empty_slots)
check_next_slot_mapping(llm, answer)           the slot of every token of the next step
"""

from __future__ import annotations

import copy
import functools

from pagedkv.engine.llm import LLM
from pagedkv.exercises import CheckResult, exercise, plain


def show_cache_state(llm: LLM, group: int = 0) -> str:
    """The running requests (in scheduling order) with their block table rows, and the free queue."""
    manager = llm.kv_cache_manager
    lines = [f"block_size = {manager.specs[group].block_size}"]
    for req in llm.scheduler.running:
        lines.append(
            f"request {req.request_id}: {req.num_tokens} tokens, {req.num_computed_tokens} in the cache, "
            f"block table row {manager.get_block_ids(req.request_id)[group]}"
        )
    queue = list(manager.block_pools[group].free_queue)
    lines.append(f"free queue (head first): {queue[:8]}{' ...' if len(queue) > 8 else ''}")
    return "\n".join(lines)


@exercise("02: blocks held and empty slots")
def check_blocks_held(llm: LLM, req_id: str, num_blocks: object, num_empty_slots: object) -> CheckResult:
    """How many blocks does the request hold now, and how many of their slots are still empty?"""
    req = next((r for r in llm.scheduler.running if r.request_id == req_id), None)
    if req is None:
        return CheckResult(False, f"Request {req_id!r} is not running in this engine; see show_cache_state(llm).")
    try:  # plain ints: an answer's own == takes no part in the comparisons
        num_blocks, num_empty_slots = plain((num_blocks, num_empty_slots), (0, 0))
    except TypeError as error:
        return CheckResult(False, f"Give two whole numbers (ints): {error}.")
    bs = llm.kv_cache_manager.specs[0].block_size
    held = len(llm.kv_cache_manager.get_block_ids(req_id)[0])
    cached = req.num_computed_tokens
    empty = held * bs - cached

    def worked() -> str:
        return (
            f"request {req_id}: {cached} tokens in the cache, blocks of {bs}: ceil({cached} / {bs}) = {held} "
            f"blocks; they hold {held} x {bs} = {held * bs} slots, {cached} filled, so {empty} empty "
            "(all in the last block)"
        )

    if num_blocks != held:
        if num_blocks == cached // bs and cached % bs:
            hint = "that rounds down, but a partly filled block is held too: round up"
        elif num_blocks == -(-req.num_tokens // bs):
            hint = (
                "that counts the token sampled last, whose K/V are not in the cache yet (the next step "
                "computes them): count the tokens in the cache"
            )
        else:
            hint = "a request holds ceil(tokens in the cache / block_size) blocks"
        return CheckResult(False, f"number of blocks: {num_blocks} is not it; {hint}.", reveal=worked)
    if num_empty_slots != empty:
        if num_empty_slots == held * bs - req.num_tokens:
            hint = "that counts the token sampled last as filled, but its K/V are not in the cache yet"
        else:
            hint = (
                "the blocks hold blocks x block_size slots, and the tokens in the cache fill them in order: "
                "only the last block can have empty slots"
            )
        return CheckResult(False, f"empty slots: {num_empty_slots} is not it; {hint}.", reveal=worked)
    return CheckResult(True, f"request {req_id}: {held} blocks, {empty} empty slot(s), all in its last block. Correct.")


@exercise("02: the next step's slot mapping")
def check_next_slot_mapping(llm: LLM, answer: object, group: int = 0) -> CheckResult:
    """The slot mapping (KV cache group `group`) of the step `llm.step()` would run next.

    The answer's form is checked first (a list of ints), so the slots are worked out (on a copy of
    the scheduler: the engine is untouched) only once nothing of the student's can run any more.
    """
    if answer is not None:
        try:  # plain ints: an answer's own == takes no part in the comparisons
            answer = plain(answer, [0])
        except TypeError as error:
            return CheckResult(False, f"The answer is a list of slot numbers (ints): {error}.")

    scheduler = copy.deepcopy(llm.scheduler)
    plan = scheduler.schedule()
    bs = scheduler.kv_cache_manager.specs[group].block_size
    tokens = []  # (request id, position, its block table row after the step, how many blocks it held before)
    for s in plan.scheduled:
        rid = s.request.request_id
        old_rows = llm.kv_cache_manager.get_block_ids(rid)  # the engine's own manager: before the step
        row, held = scheduler.kv_cache_manager.get_block_ids(rid)[group], len(old_rows[group]) if old_rows else 0
        start = s.request.num_computed_tokens
        tokens += [(rid, p, row, held) for p in range(start, start + s.num_new_tokens)]
    slots = [row[p // bs] * bs + p % bs for _, p, row, _ in tokens]
    if answer is None:
        return CheckResult(False, f"Give a list of {len(tokens)} slots, one per token of the next step.")
    if len(answer) != len(tokens):
        return CheckResult(False, f"The next step computes {len(tokens)} token(s); you gave {len(answer)} slot(s).")

    def mistake(got: int, p: int, row: list[int], held: int) -> str:
        """Which step of the lookup a wrong slot `got` skipped or got wrong (without the right slot)."""
        j = p // bs
        if got == p:  # = j * block_size + offset: the logical block where the physical one belongs
            return (
                "position used directly (that is the logical block, not the physical one): the cache is not "
                "one contiguous array per request; look the token's block up in the request's block table row"
            )
        if got == row[j]:
            return "that is the physical block id; a slot also needs * block_size + offset"
        if got == row[j] * bs:
            return "that is the block's first slot; add the token's offset inside the block"
        if (p + 1) // bs < len(row) and got == row[(p + 1) // bs] * bs + (p + 1) % bs:
            return "one position too far: the token's position is the number of tokens already in the cache"
        if j >= held:
            return (
                "this token does not fit the blocks the request held: the step first gives it a new block, "
                "from the head of the free queue"
            )
        if got // bs == row[j]:
            return "right block, wrong offset: the offset is position % block_size"
        return "slot = row[position // block_size] * block_size + position % block_size"

    def worked(rid: str, p: int, row: list[int], held: int) -> str:
        j, b, offset = p // bs, row[p // bs], p % bs
        new = (
            f" (its row held {held} block(s), so this step first takes block {b} from the head of the free queue)"
            if j >= held
            else ""
        )
        return (
            f"request {rid}, position {p}: logical block {p} // {bs} = {j}, physical block row[{j}] = {b}{new}, "
            f"offset {p} % {bs} = {offset}, slot {b} * {bs} + {offset} = {b * bs + offset}"
        )

    for i, (token, got, want) in enumerate(zip(tokens, answer, slots)):
        if got != want:
            rid, p = token[0], token[1]
            return CheckResult(
                False,
                f"next step's slot mapping, entry {i} (request {rid}'s token at position {p}): "
                f"{got} is not it; {mistake(got, *token[1:])}.",
                reveal=functools.partial(worked, *token),
            )
    return CheckResult(True, f"next step's slot mapping {slots}: correct.")
