"""Notebook 12 (prefix caching): checkers for the hit length of a prompt and for the block that
the next allocation takes.

Each runs the student's function on the notebook's cases, on cases that each need one rule of the
pool, and on prompts and event lists it makes up, all before it works out any answer; only then does
it replay every case on the package's real `KVCacheManager` (prefix caching on) for the expected
value. Answers that call the manager, the block pool or the hash functions are turned away, and a
wrong answer is told which rule it broke, never the expected value: `reveal()` works the failing
case out, after three tries.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.kv_cache.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import FullAttentionSpec, get_kv_cache_config

PACKAGE: list[Callable[..., Any]] = [
    KVCacheManager.__init__,
    KVCacheManager.get_computed_blocks,
    KVCacheManager.allocate_slots,
    KVCacheManager.free,
    BlockPool.__init__,
    BlockPool.get_cached_block,
    BlockPool.get_new_blocks,
    BlockPool.touch,
    BlockPool.free_blocks,
    BlockPool.cache_full_blocks,
    hash_block_tokens,
    hash_request_blocks,
]
"""What an answer may not call: the machinery whose result it is asked to predict."""

Event = tuple[Any, ...]
"""("add", request_id, token_ids): a request arrives and its whole prompt is computed;
("free", request_id): it finishes and gives its blocks back."""


def _manager(block_size: int, num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheManager(get_kv_cache_config({"layer": spec}, num_blocks=num_blocks), enable_caching=True)


def _add(kv: KVCacheManager, req_id: str, token_ids: list[int]) -> bool:
    """Admit a request as the scheduler does: take its cached prefix, allocate and cache the rest.
    False (and nothing held) if its blocks do not fit."""
    hits, num_hit = kv.get_computed_blocks(req_id, token_ids)
    if kv.allocate_slots(req_id, num_hit, len(token_ids) - num_hit, hits, token_ids=token_ids):
        return True
    kv.free(req_id)  # forgets the hashes the lookup computed
    return False


@dataclass
class _Raised:
    """What a student's call raised, kept in its case's place: a wrong answer that raises only on a later,
    made-up case is still told about the first case it gets wrong."""

    error: Exception

    def message(self, call: str) -> str:
        first_line = (str(self.error).splitlines() or [""])[0]
        return f"{call} raised {type(self.error).__name__}: {first_line}."


def _plain_int(call: str, got: Any, what: str) -> int | CheckResult:
    """`got` as a plain int (`plain`: its own == takes no part), or the failed result for an answer
    that raised or is not an int (`what` it should be)."""
    if isinstance(got, _Raised):
        return CheckResult(False, got.message(call))
    try:
        return plain(got, 0)
    except TypeError as error:
        return CheckResult(False, f"{call}: {error}; return {what} (an int).")


def _keep_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, returning a `_Raised` instead of raising (the package guard still watches every call)."""

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001  (the student's code may raise anything)
            return _Raised(error)

    return run


# ---- exercise 1: how many prompt tokens does the cache hold? ---------------------------------

SYSTEM = [7, 3, 9, 4, 1, 8, 2, 6, 5]
"""A 9-token "system prompt" shared by the notebook's cases."""
SHOWN_HIT_CASES: list[tuple[list[list[int]], list[int], int]] = [
    ([SYSTEM + [20, 21, 22]], SYSTEM + [30, 31], 4),  # the same system prompt, another question
    ([list(range(1, 9))], list(range(1, 9)), 4),  # a prompt served before, sent again
    ([list(range(1, 9))], list(range(1, 10)), 4),  # one token longer than a served one
    ([list(range(1, 13))], list(range(1, 7)) + [99, 98, 97], 4),  # differs inside the second block
    ([list(range(1, 5)) + [50, 51, 52, 53], list(range(1, 13))], list(range(1, 14)), 4),  # two served prompts
]
"""(cached_prompts, prompt, block_size) cases the notebook can print."""


def _random_hit_case(rng: random.Random) -> tuple[list[list[int]], list[int], int]:
    """Cached prompts built on a shared system prompt; the prompt equals one of them, extends it,
    or leaves it at a random token."""
    bs = rng.choice([2, 3, 4, 8])
    system = [rng.randrange(1, 100) for _ in range(rng.randint(bs, 4 * bs))]
    cached = [
        system[: rng.randint(1, len(system))] + [rng.randrange(1, 100) for _ in range(rng.randint(0, 2 * bs))]
        for _ in range(rng.randint(1, 3))
    ]
    base = rng.choice(cached)
    kind = rng.choice(["equal", "longer", "diverge", "diverge"])
    if kind == "equal":
        prompt = list(base)
    elif kind == "longer":
        prompt = base + [rng.randrange(1, 100) for _ in range(rng.randint(1, bs))]
    else:
        cut = rng.randint(0, len(base) - 1)
        prompt = base[:cut] + [100 + rng.randrange(100)] + [rng.randrange(1, 100) for _ in range(rng.randint(0, bs))]
    return cached, prompt, bs


@exercise("12: the tokens found in the cache")
def check_hit_length(fn: Callable[[list[list[int]], list[int], int], Any], num_hidden: int = 30) -> CheckResult:
    """`fn(cached_prompts, prompt, block_size)` -> how many tokens of `prompt` the prefix cache
    holds once every prompt of `cached_prompts` was served (computed, then finished), in a cache
    large enough that nothing was evicted."""
    own = package_answer(fn, PACKAGE, "the lookup")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_HIT_CASES + [_random_hit_case(rng) for _ in range(num_hidden)]
    results, rejected = call_on_cases(
        _keep_errors(fn),
        [([list(p) for p in cached], list(prompt), bs) for cached, prompt, bs in cases],
        PACKAGE,
        "the lookup",
        lambda case: f"fn{case}",
    )
    if rejected is not None:
        return rejected

    def found(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        """Serve every cached prompt on a real manager with room for all, then look `prompt` up."""
        kv = _manager(block_size, 2 + sum(math.ceil(len(p) / block_size) for p in cached_prompts))
        for i, tokens in enumerate(cached_prompts):
            assert _add(kv, f"served-{i}", tokens)
            kv.free(f"served-{i}")
        return kv.get_computed_blocks("new", prompt)[1]

    for (cached, prompt, bs), got in zip(cases, results):
        call = f"fn({cached}, {prompt}, {bs})"
        if isinstance(got := _plain_int(call, got, "a number of tokens"), CheckResult):
            return got
        expected = found(cached, prompt, bs)
        if got == expected:
            continue

        def worked(
            cached: list[list[int]] = cached,
            prompt: list[int] = prompt,
            bs: int = bs,
            expected: int = expected,
            call: str = call,
        ) -> str:
            usable = (len(prompt) - 1) // bs
            lines = [
                f"block_size {bs}: the prompt has {len(prompt)} tokens; its last one is always computed, so only "
                f"its first ({len(prompt)} - 1) // {bs} = {usable} block(s) can be found"
            ]
            for j in range(usable):
                prefix = prompt[: (j + 1) * bs]
                owner = next(
                    (i for i, c in enumerate(cached) if len(c) >= len(prefix) and c[: len(prefix)] == prefix), None
                )
                if owner is None:
                    lines.append(
                        f"block {j} {prompt[j * bs : (j + 1) * bs]}: no served prompt starts with these "
                        f"{len(prefix)} tokens: the hit ends here"
                    )
                    break
                lines.append(
                    f"block {j} {prompt[j * bs : (j + 1) * bs]}: served prompt {owner} starts with the same "
                    f"{len(prefix)} tokens and filled this block: found"
                )
            return "\n".join([*lines, f"{call} = {expected} tokens"])

        if got % bs:
            hint = f"the cache holds whole blocks, so a hit is a multiple of block_size = {bs}"
        elif got == found(cached, [*prompt, -1], bs):
            hint = (
                "the last prompt token is always computed (its logits give the first new token), so the block "
                "holding it never counts as a hit"
            )
        elif got > expected:
            hint = (
                "blocks match from the first one on, each through the hash of the whole prefix up to its end: "
                "the first block that no served prompt shares (with everything before it) ends the hit, and "
                "only FULL blocks of a served prompt were cached"
            )
        else:
            hint = (
                "every served prompt left its full blocks in the cache: the hit is the longest run of leading "
                "blocks that some served prompt shares with this one"
            )
        return CheckResult(False, f"{call} = {got} is not the hit; {hint}.", reveal=worked)
    return CheckResult(True, f"Your hit lengths match the KV cache manager's on {len(cases)} cases.")


# ---- exercise 2: which block does the next allocation take? ----------------------------------

SHOWN_EVICTION_CASES: list[tuple[list[Event], int, int]] = [
    ([("add", "A", list(range(1, 11))), ("free", "A")], 6, 4),
    ([("add", "A", list(range(1, 11))), ("free", "A"), ("add", "B", list(range(50, 58)))], 6, 4),
    ([("add", "A", list(range(1, 11))), ("free", "A"), ("add", "B", list(range(1, 9)) + [60, 61])], 6, 4),
    (
        [
            ("add", "A", list(range(1, 9))),
            ("free", "A"),
            ("add", "B", list(range(20, 28))),
            ("add", "C", [30, 31, 32, 33]),
        ],
        5,
        4,
    ),
]
"""(events, num_blocks, block_size) cases the notebook can print."""

RULE_CASES: list[tuple[list[Event], int, int]] = [
    # the block holding a prompt's last token is never a hit (it is computed again)
    ([("add", "A", [94, 63, 81]), ("add", "B", [94, 63])], 6, 2),
    # a hit block leaves the free queue
    (
        [
            ("add", "A", [80, 59]),
            ("add", "B", [77, 6, 13]),
            ("free", "A"),
            ("add", "D", [80, 59, 21, 61, 25]),
            ("free", "B"),
        ],
        6,
        2,
    ),
    # a block taken from the queue loses the prefix it cached
    (
        [
            ("add", "A", [71, 70, 31, 30]),
            ("free", "A"),
            ("add", "C", [32, 85, 41, 47, 25, 56]),
            ("free", "C"),
            ("add", "E", [71, 3, 46, 36, 79]),
            ("free", "E"),
            ("add", "G", [71, 70, 31, 30]),
            ("free", "G"),
        ],
        6,
        2,
    ),
    # a prefix cached already keeps its block; a second block with the same tokens caches nothing
    (
        [
            ("add", "A", [60, 51, 59]),
            ("add", "B", [91, 28, 91]),
            ("add", "C", [91, 28]),
            ("free", "C"),
            ("free", "B"),
            ("add", "G", [91, 28, 9]),
        ],
        7,
        2,
    ),
]
"""Checked on every call: one case per rule of the pool that random events reach only now and then
(found by simulating answers that each break one rule)."""


def _random_events(rng: random.Random) -> tuple[list[Event], int, int]:
    """Requests on two system prompts arrive and finish on a small pool; every one fits, and some
    block is free at the end."""
    bs = rng.choice([2, 4])
    num_blocks = rng.randint(6, 12)
    systems = [[rng.randrange(1, 100) for _ in range(rng.randint(bs, 3 * bs))] for _ in range(2)]
    kv = _manager(bs, num_blocks)
    events: list[Event] = []
    running: list[str] = []
    for i in range(rng.randint(3, 8)):
        if running and rng.random() < 0.4:
            req_id = running.pop(rng.randrange(len(running)))
            kv.free(req_id)
            events.append(("free", req_id))
            continue
        system = rng.choice(systems)
        tokens = system[: rng.randint(1, len(system))] + [rng.randrange(1, 100) for _ in range(rng.randint(0, 2 * bs))]
        req_id = chr(ord("A") + i)
        if _add(kv, req_id, tokens):
            events.append(("add", req_id, tokens))
            running.append(req_id)
    while not kv.block_pools[0].free_queue:  # a request whose blocks are all shared frees none
        req_id = running.pop(0)
        kv.free(req_id)
        events.append(("free", req_id))
    return events, num_blocks, bs


@exercise("12: the next block taken")
def check_next_block(fn: Callable[[list[Event], int, int], Any], num_hidden: int = 30) -> CheckResult:
    """`fn(events, num_blocks, block_size)` -> the id of the block the next allocation takes once
    `events` happened on a fresh pool of `num_blocks` blocks (prefix caching on)."""
    own = package_answer(fn, PACKAGE, "the free queue")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_EVICTION_CASES + RULE_CASES + [_random_events(rng) for _ in range(num_hidden)]
    theirs = [
        ([(e[0], e[1], list(e[2])) if e[0] == "add" else e for e in events], num_blocks, bs)  # to change
        for events, num_blocks, bs in cases
    ]
    results, rejected = call_on_cases(
        _keep_errors(fn),
        theirs,
        PACKAGE,
        "the free queue",
        lambda case: f"fn({case[0]}, num_blocks={case[1]}, block_size={case[2]})",
    )
    if rejected is not None:
        return rejected

    def queues(events: list[Event], num_blocks: int, bs: int) -> list[list[int]]:
        """The free queue (head first) of a real manager before and after each event."""
        kv = _manager(bs, num_blocks)
        pool = kv.block_pools[0]
        seen = [list(pool.free_queue)]
        for event in events:
            if event[0] == "add":
                assert _add(kv, event[1], list(event[2])), f"{event} does not fit"
            else:
                kv.free(event[1])
            seen.append(list(pool.free_queue))
        return seen

    for (events, num_blocks, bs), got in zip(cases, results):
        call = f"fn({events}, num_blocks={num_blocks}, block_size={bs})"
        if isinstance(got := _plain_int(call, got, "a block id"), CheckResult):
            return got
        steps = queues(events, num_blocks, bs)
        queue = steps[-1]
        if got == queue[0]:
            continue

        def worked(events: list[Event] = events, steps: list[list[int]] = steps, call: str = call) -> str:
            lines = [f"free queue at the start, head first: {steps[0]}"]
            for event, after in zip(events, steps[1:]):
                what = f"add {event[1]} ({len(event[2])} tokens)" if event[0] == "add" else f"free {event[1]}"
                lines.append(f"after {what}: {after}")
            return "\n".join([*lines, f"{call} = {steps[-1][0]}, the head"])

        rules = (
            "a freed request's blocks go to the tail, last block first; a cache hit takes its block out of the "
            "queue, wherever it is; new blocks come from the head and lose the prefix they cached"
        )
        if not 0 < got < num_blocks:
            hint = f"block ids run from 1 to num_blocks - 1 = {num_blocks - 1} (block 0 is the null block, never free)"
        elif got not in queue:
            hint = (
                f"block {got} is still held by a running request when the events end, and only a block in the "
                f"free queue can be taken: {rules}"
            )
        else:
            hint = f"block {got} is in the free queue then, but not at its head: {rules}"
        return CheckResult(False, f"{call} = {got} is not the next block; {hint}.", reveal=worked)
    return CheckResult(True, f"Your next block matches the block pool's on {len(cases)} sequences of events.")
