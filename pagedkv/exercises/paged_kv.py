"""Exercises of notebook 02 (the paged KV cache). Answers are recomputed from a live engine.

    show_cache_state(llm)                          what the student may look at
    check_blocks_held(llm, req_id, num_blocks, num_empty_slots)
    check_next_slot_mapping(llm, answer)           the slot of every token of the next step
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from pagedkv.engine.llm import LLM
from pagedkv.exercises import CheckResult


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


def check_blocks_held(llm: LLM, req_id: str, num_blocks: object, num_empty_slots: object) -> CheckResult:
    """How many blocks does the request hold now, and how many of their slots are still empty?"""
    req = next((r for r in llm.scheduler.running if r.request_id == req_id), None)
    if req is None:
        return CheckResult(False, f"Request {req_id!r} is not running in this engine; see show_cache_state(llm).")
    if num_blocks is ... or num_empty_slots is ...:
        return CheckResult(False, "Replace both `...` with numbers, then run the cell again.")
    bs = llm.kv_cache_manager.specs[0].block_size
    held = len(llm.kv_cache_manager.get_block_ids(req_id)[0])
    cached = req.num_computed_tokens
    empty = held * bs - cached
    if num_blocks != held:
        return CheckResult(False, (
            f"number of blocks: expected {held}, got {num_blocks!r}. The request has {cached} tokens in the "
            f"cache and a block holds {bs}: it needs ceil({cached} / {bs}) = {held} blocks."
        ))
    if num_empty_slots != empty:
        return CheckResult(False, (
            f"empty slots: expected {empty}, got {num_empty_slots!r}. {held} blocks hold {held * bs} slots, "
            f"{cached} of them are filled; only the last block can have empty slots."
        ))
    return CheckResult(True, f"request {req_id}: {held} blocks, {empty} empty slot(s), all in its last block. Correct.")


@dataclass
class _Token:
    """One token of the next step and how its slot comes about."""

    req_id: str
    position: int
    row: list[int]
    old_row_len: int
    block_size: int

    @property
    def logical(self) -> int:
        return self.position // self.block_size

    @property
    def offset(self) -> int:
        return self.position % self.block_size

    @property
    def slot(self) -> int:
        return self.row[self.logical] * self.block_size + self.offset

    def explain(self, got: object) -> str:
        bs, j, b = self.block_size, self.logical, self.row[self.logical]
        why = (
            f"request {self.req_id}, position {self.position}: logical block {self.position} // {bs} = {j}, "
            f"physical block row[{j}] = {b}, offset {self.position} % {bs} = {self.offset}, "
            f"so slot {b} * {bs} + {self.offset} = {self.slot}; you wrote {got!r}."
        )
        if j >= self.old_row_len:
            why += (
                f" Its row had only {self.old_row_len} block(s), so this step first takes a new block "
                "from the head of the free queue."
            )
        if got == self.position:
            why += " That is the position itself: the cache is not one contiguous array per request."
        elif got == j * bs + self.offset:
            why += " You used the logical block number; look the physical one up in the block table."
        elif got == b:
            why += " That is the block id; a slot also needs * block_size + offset."
        return why


def _next_step_tokens(llm: LLM, group: int = 0) -> list[_Token]:
    """Schedule the next step on a copy of the scheduler (and its KV cache manager): the engine is untouched."""
    scheduler = copy.deepcopy(llm.scheduler)
    plan = scheduler.schedule()
    bs = scheduler.kv_cache_manager.specs[group].block_size
    tokens = []
    for s in plan.scheduled:
        rid = s.request.request_id
        row = scheduler.kv_cache_manager.get_block_ids(rid)[group]
        old_rows = llm.kv_cache_manager.get_block_ids(rid)  # the engine's own manager: before the step
        old_len = len(old_rows[group]) if old_rows else 0
        start = s.request.num_computed_tokens
        tokens += [_Token(rid, p, row, old_len, bs) for p in range(start, start + s.num_new_tokens)]
    return tokens


def check_next_slot_mapping(llm: LLM, answer: object) -> CheckResult:
    """The slot mapping (KV cache group 0) of the step `llm.step()` would run next."""
    tokens = _next_step_tokens(llm)
    expected = [t.slot for t in tokens]
    if answer is ... or answer is None:
        return CheckResult(False, f"Replace `...` with a list of {len(expected)} slots, one per token of the next step.")
    if not isinstance(answer, (list, tuple)):
        return CheckResult(False, f"The answer is a list of slot numbers, got {type(answer).__name__}.")
    if len(answer) != len(expected):
        return CheckResult(False, f"The next step computes {len(expected)} token(s); you gave {len(answer)} slot(s).")
    for token, got in zip(tokens, answer):
        if got != token.slot:
            return CheckResult(False, "next step's slot mapping: " + token.explain(got))
    return CheckResult(True, f"next step's slot mapping {expected}: correct.")
