"""The values of a loaded trace, checked before any view draws them.

A trace file may come from anywhere (another machine, a hand edit, a truncated copy). Its shape is
checked as it is read (`step_trace._from_plain`); this module checks what the values mean: counts are
ints >= 0, block ids lie in the engine's pool, slots in its cache, and the sizes a view allocates
for (a list per block, a row per token) are bounded, so that a file claiming `num_blocks=10**10` is
refused here instead of making a widget allocate 80 GB. Each error names the field by its path,
such as `steps[3].requests[0].block_ids[0][2]`, and the range that would work.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagedkv.trace.records import EngineInfo, StepRecord

MAX_NUM_BLOCKS = 2**24
"""The most blocks a trace's pool may have: 16.7M. A view keeps a few values per block (ref counts,
hashes), so this bounds what loading a trace can cost at about a GB; a real cache of a tiny model
on an H200 holds a few million blocks."""
MAX_BLOCK_SIZE = 2**16
"""The most tokens per block (vLLM's largest block sizes are in the hundreds)."""
MAX_COUNT = 2**40
"""The most tokens, requests or steps any count may hold (far above any real run)."""


def check_int(where: str, value: object, low: int, high: int, what: str = "") -> int:
    """`value` as an int in [low, high), or a ValueError naming `where` and the range (`what` says why)."""
    if type(value) is not int or not low <= value < high:
        raise ValueError(f"{where} = {value!r}: must be an int in [{low}, {high}){what}.")
    return value


def check_ints(where: str, values: object, low: int, high: int, what: str = "") -> None:
    """Each entry of the list `values` as `check_int` checks it (the error names the entry's index)."""
    for i, value in enumerate(_as_list(where, values)):
        check_int(f"{where}[{i}]", value, low, high, what)


def _as_list(where: str, value: object) -> list[object]:
    if not isinstance(value, list):
        raise ValueError(f"{where} = {value!r}: must be a list.")
    return value


def check_engine_info(engine: EngineInfo) -> None:
    """The sizes every view relies on: block size, pool size, batch limits, cache shapes."""
    check_int("engine.block_size", engine.block_size, 1, MAX_BLOCK_SIZE + 1, " (tokens per block)")
    check_int("engine.num_blocks", engine.num_blocks, 1, MAX_NUM_BLOCKS + 1, " (blocks per KV cache group)")
    check_int("engine.max_num_batched_tokens", engine.max_num_batched_tokens, 1, MAX_COUNT)
    check_int("engine.max_num_seqs", engine.max_num_seqs, 1, MAX_COUNT)
    for name, shape in engine.kv_cache_shapes.items():
        check_ints(f"engine.kv_cache_shapes[{name!r}]", shape, 0, MAX_COUNT)
    for i, group in enumerate(engine.kv_cache_groups):
        check_int(f"engine.kv_cache_groups[{i}].group_id", group.group_id, 0, MAX_COUNT)
    num_groups = len(engine.kv_cache_groups)
    for i, attn_group in enumerate(engine.attention_groups):
        check_int(
            f"engine.attention_groups[{i}].kv_cache_group_id",
            attn_group.kv_cache_group_id,
            0,
            max(num_groups, 1),
            f" (one of the {num_groups} KV cache groups)",
        )


def check_step(where: str, step: StepRecord, engine: EngineInfo) -> None:
    """One step's counts, block ids and slots against the engine's pool."""
    blocks = engine.num_blocks
    in_pool = f" (a block of the pool: engine.num_blocks is {blocks})"
    check_int(f"{where}.step", step.step, 0, MAX_COUNT)
    for r, request in enumerate(step.requests):
        at = f"{where}.requests[{r}]"
        for name in ("num_computed_tokens", "num_new_tokens", "num_prompt_tokens", "num_cached_tokens"):
            check_int(f"{at}.{name}", getattr(request, name), 0, MAX_COUNT)
        for g, row in enumerate(_as_list(f"{at}.block_ids", request.block_ids)):
            check_ints(f"{at}.block_ids[{g}]", row, 0, blocks, in_pool)
        for g, row in enumerate(_as_list(f"{at}.rolled_back_block_ids", request.rolled_back_block_ids)):
            check_ints(f"{at}.rolled_back_block_ids[{g}]", row, 0, blocks, in_pool)
        if request.num_accepted_tokens is not None:
            drafts = len(_as_list(f"{at}.draft_token_ids", request.draft_token_ids))
            check_int(f"{at}.num_accepted_tokens", request.num_accepted_tokens, 0, drafts + 1, " (at most the drafts)")
    check_ints(f"{where}.input_ids", step.input_ids, 0, MAX_COUNT)
    check_ints(f"{where}.positions", step.positions, 0, MAX_COUNT)
    slots = blocks * engine.block_size
    for g, mapping in enumerate(_as_list(f"{where}.slot_mappings", step.slot_mappings)):
        check_ints(f"{where}.slot_mappings[{g}]", mapping, -1, slots, " (a slot of the cache, or -1 for padding)")
    check_ints(f"{where}.num_blocks_in_use", step.num_blocks_in_use, 0, blocks + 1)
    check_ints(f"{where}.num_free_blocks", step.num_free_blocks, 0, blocks + 1)
    if not isinstance(step.duration_s, (int, float)) or not math.isfinite(step.duration_s) or step.duration_s < 0:
        raise ValueError(f"{where}.duration_s = {step.duration_s!r}: must be a number of seconds >= 0.")
    if step.mla_split is not None:
        for name in ("num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens"):
            check_int(f"{where}.mla_split.{name}", getattr(step.mla_split, name), 0, MAX_COUNT)
    for g, pool in enumerate(step.block_pools):
        at = f"{where}.block_pools[{g}]"
        check_int(f"{at}.num_blocks", pool.num_blocks, blocks, blocks + 1, " (engine.num_blocks)")
        for i, (block, ref_cnt) in enumerate(_pairs(f"{at}.held", pool.held)):
            check_int(f"{at}.held[{i}][0]", block, 0, blocks, in_pool)
            check_int(f"{at}.held[{i}][1]", ref_cnt, 0, MAX_COUNT, " (a reference count)")
        for i, (block, _) in enumerate(_pairs(f"{at}.cached", pool.cached)):
            check_int(f"{at}.cached[{i}][0]", block, 0, blocks, in_pool)
        for i, (first, last) in enumerate(_pairs(f"{at}.free_queue", pool.free_queue)):
            start = check_int(f"{at}.free_queue[{i}][0]", first, 0, blocks, in_pool)
            check_int(f"{at}.free_queue[{i}][1]", last, start, blocks, " (a run [first, last] of block ids)")


def _pairs(where: str, value: object) -> Iterable[list[object]]:
    for i, pair in enumerate(_as_list(where, value)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}[{i}] = {pair!r}: must be a pair [a, b].")
        yield pair


def check_trace_values(engine: EngineInfo, steps: list[StepRecord]) -> None:
    """Every value of a loaded trace that a view reads (see the module's docstring)."""
    check_engine_info(engine)
    for i, step in enumerate(steps):
        check_step(f"steps[{i}]", step, engine)
