"""Notebook 12's checkers: right answers written here from the rules (not from the package) pass; wrong ones,
the answers that fooled the second edition (the manager, pool or hash functions called directly or on a
thread, the checker's frame read, the notebook's answers copied as constants) fail with a message that holds
no expected value."""

from __future__ import annotations

import functools
import math
import random
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pagedkv.exercises import prefix_caching, reveal
from pagedkv.exercises.prefix_caching import (
    RULE_CASES,
    SHOWN_EVICTION_CASES,
    SHOWN_HIT_CASES,
    check_hit_length,
    check_next_block,
)
from pagedkv.kv_cache.block_pool import hash_request_blocks
from pagedkv.kv_cache.manager import KVCacheManager
from tests.exercises.checks import EqualToAnything, assert_rejected, assert_worked_solutions_pass


def replay_on_the_package(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
    """The head of a real manager's free queue after `events` (what the second edition's `replay` gave)."""
    kv = prefix_caching._manager(block_size, num_blocks)
    for event in events:
        if event[0] == "add":
            prefix_caching._add(kv, event[1], list(event[2]))
        else:
            kv.free(event[1])
    return next(iter(kv.block_pools[0].free_queue))


def right_hit_length(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    usable = (len(prompt) - 1) // block_size  # the last token is always computed
    best = 0
    for cached in cached_prompts:
        n = 0
        while (
            n < min(len(cached) // block_size, usable)
            and cached[n * block_size : (n + 1) * block_size] == prompt[n * block_size : (n + 1) * block_size]
        ):
            n += 1
        best = max(best, n)
    return best * block_size


def right_next_block(events: list[tuple[Any, ...]], num_blocks: int, block_size: int, broken: str = "") -> int:
    """A pool simulated with token prefixes as the cache keys (equal prefixes, equal hashes).
    `broken` names one rule to break, as a student's answer might (see the test of RULE_CASES)."""
    free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
    ref = [0] * num_blocks
    key_of: dict[int, tuple[int, ...]] = {}  # block -> the prefix it caches
    block_of: dict[tuple[int, ...], int] = {}
    rows: dict[str, list[int]] = {}
    for event in events:
        if event[0] == "free":
            for block in reversed(rows.pop(event[1])):
                ref[block] -= 1
                if ref[block] == 0:
                    free[block] = None
            continue
        _, req_id, tokens = event
        row = []
        for j in range((len(tokens) - (broken != "last token hits")) // block_size):
            block = block_of.get(tuple(tokens[: (j + 1) * block_size]))
            if block is None:
                break
            if broken != "hits stay free":
                free.pop(block, None)
            ref[block] += 1
            row.append(block)
        while len(row) < math.ceil(len(tokens) / block_size):
            block = free.popitem(last=False)[0]
            if broken != "evicted keep prefix":
                block_of.pop(key_of.pop(block, None), None)  # evicted
            ref[block] = 1
            row.append(block)
        for j, block in enumerate(row[: len(tokens) // block_size]):
            key = tuple(tokens[: (j + 1) * block_size])
            if broken == "newest block caches" or (block not in key_of and key not in block_of):
                key_of[block], block_of[key] = key, block
        rows[req_id] = row
    return next(iter(free))


def test_hit_length() -> None:
    result = check_hit_length(right_hit_length)
    assert result, result.message
    assert [right_hit_length(*case) for case in SHOWN_HIT_CASES] == [8, 4, 8, 4, 12]


def test_hit_length_rejects_wrong_answers() -> None:
    def common_tokens(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return max(
            next((i for i, (a, b) in enumerate(zip(c, prompt)) if a != b), min(len(c), len(prompt)))
            for c in cached_prompts
        )

    def without_last_token_rule(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return right_hit_length(cached_prompts, [*prompt, -1], block_size)

    def first_prompt_only(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return right_hit_length(cached_prompts[:1], prompt, block_size)

    result = check_hit_length(common_tokens)
    assert_rejected(result, "whole blocks", "fn([[7, 3, 9", "= 9 is not the hit")
    assert " 8" not in result.message.split("is not the hit")[1]  # the hit: two blocks of 4
    result = check_hit_length(without_last_token_rule)
    assert not result and "last prompt token is always computed" in result.message
    result = check_hit_length(first_prompt_only)  # the fifth shown case: the second prompt matches more (12)
    assert_rejected(result, "fn([[1, 2, 3, 4, 50, 51, 52, 53], [1, 2", "is not the hit", "every served prompt")
    assert "12" not in result.message.split("is not the hit")[1]
    assert not check_hit_length(lambda *args: "8") and not check_hit_length(lambda *args: 1 / 0)
    assert not check_hit_length(8)


def test_hit_length_rejects_the_package() -> None:
    def by_hashes(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        known = {h for c in cached_prompts for h in hash_request_blocks(c, block_size)}
        hashes = hash_request_blocks(prompt, block_size)[: (len(prompt) - 1) // block_size]
        return next((i for i, h in enumerate(hashes) if h not in known), len(hashes)) * block_size

    result = check_hit_length(by_hashes)
    assert_rejected(result, "calls hash_request_blocks")

    def on_a_thread(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(by_hashes, cached_prompts, prompt, block_size).result()

    assert_rejected(check_hit_length(on_a_thread), "calls hash_request_blocks")

    def served_on_a_real_manager(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        kv = prefix_caching._manager(block_size, 64)
        for i, tokens in enumerate(cached_prompts):
            prefix_caching._add(kv, str(i), tokens)
            kv.free(str(i))
        return kv.get_computed_blocks("new", prompt)[1]

    assert_rejected(check_hit_length(served_on_a_real_manager), "calls KVCacheManager.__init__")
    assert_rejected(
        check_hit_length(lambda *a: ThreadPoolExecutor().submit(served_on_a_real_manager, *a).result()),
        "calls KVCacheManager.__init__",
    )
    result = check_hit_length(KVCacheManager.get_computed_blocks)
    assert not result and "pagedkv's own KVCacheManager.get_computed_blocks" in result.message


def test_next_block() -> None:
    result = check_next_block(right_next_block)
    assert result, result.message
    assert [right_next_block(*case) for case in SHOWN_EVICTION_CASES] == [4, 3, 5, 1]


@pytest.mark.parametrize("broken", ["last token hits", "hits stay free", "evicted keep prefix", "newest block caches"])
def test_next_block_rejects_each_broken_rule_every_time(broken: str) -> None:
    """Random events reached these only now and then (a rule broken passed up to 19 calls in 20):
    RULE_CASES, tried on every call, catch each one."""
    answer = functools.partial(right_next_block, broken=broken)
    assert not check_next_block(answer, num_hidden=0)
    assert any(answer(*case) != right_next_block(*case) for case in RULE_CASES)


def test_next_block_rejects_wrong_answers() -> None:
    def ignores_hits(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
        # Tokens no other request has: the cache never hands a block back.
        unique = [
            (e[0], e[1], [-1000 * k - i for i in range(len(e[2]))]) if e[0] == "add" else e
            for k, e in enumerate(events)
        ]
        return right_next_block(unique, num_blocks, block_size)

    def frees_first_block_first(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
        free = list(range(1, num_blocks))
        rows: dict[str, list[int]] = {}
        for event in events:
            if event[0] == "add":
                n = math.ceil(len(event[2]) / block_size)
                rows[event[1]], free = free[:n], free[n:]
            else:
                free += rows.pop(event[1])
        return free[0]

    result = check_next_block(ignores_hits, num_hidden=0)  # the third shown case: the head is 5, the queue [5, 3]
    assert_rejected(result, "= 2 is not the next block", "block 2 is still held by a running request")
    assert "5" not in result.message.split("is not the next block")[1] and "[5, 3]" not in result.message
    result = check_next_block(frees_first_block_first, num_hidden=0)
    assert_rejected(result, "in the free queue then, but not at its head", "last block first")
    assert_rejected(check_next_block(lambda events, n, bs: 0), "block 0 is the null block")
    assert_rejected(check_next_block(lambda events, n, bs: None), "return a block id")


def test_next_block_rejects_the_package() -> None:
    assert_rejected(check_next_block(replay_on_the_package), "calls KVCacheManager.__init__")

    def on_a_thread(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(replay_on_the_package, events, num_blocks, block_size).result()

    assert_rejected(check_next_block(on_a_thread), "calls KVCacheManager.__init__")
    assert_rejected(check_next_block(KVCacheManager.free), "pagedkv's own KVCacheManager.free")


def test_reading_the_checkers_frames_fails() -> None:
    def peek(*args: Any) -> Any:
        return sys._getframe(1).f_locals.get("expected", 1)

    assert_rejected(check_hit_length(peek), "reading the checker's frames")
    assert_rejected(check_next_block(peek), "reading the checker's frames")


def test_answers_copied_for_the_shown_cases_fail() -> None:
    hits = {repr(case[:2]): right_hit_length(*case) for case in SHOWN_HIT_CASES}
    assert_rejected(check_hit_length(lambda cached, prompt, bs: hits.get(repr((cached, prompt)), 0)), "fn(")
    heads = {repr(case[0]): right_next_block(*case) for case in SHOWN_EVICTION_CASES + RULE_CASES}
    assert_rejected(check_next_block(lambda events, n, bs: heads.get(repr(events), 1)), "fn(")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    def common_tokens(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return max(
            next((i for i, (a, b) in enumerate(zip(c, prompt)) if a != b), min(len(c), len(prompt)))
            for c in cached_prompts
        )

    for _ in range(3):
        result = check_hit_length(common_tokens)
    assert "Try 3" in result.message and "reveal()" in result.message
    reveal()
    worked = capsys.readouterr().out
    assert "only its first (11 - 1) // 4 = 2 block(s) can be found" in worked
    assert "block 1 [1, 8, 2, 6]: served prompt 0 starts with the same 8 tokens" in worked
    assert worked.rstrip().endswith("= 8 tokens")
    assert check_hit_length(right_hit_length)

    def no_cache(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
        return right_next_block(
            [
                (e[0], e[1], [-1000 * k - i for i in range(len(e[2]))]) if e[0] == "add" else e
                for k, e in enumerate(events)
            ],
            num_blocks,
            block_size,
        )

    for _ in range(3):
        result = check_next_block(no_cache, num_hidden=0)  # random events may not fit without hits
    assert "Try 3" in result.message
    reveal()
    worked = capsys.readouterr().out
    assert "free queue at the start, head first: [1, 2, 3, 4, 5]" in worked
    assert "after free A: [4, 5, 3, 2, 1]" in worked and "after add B (10 tokens): [5, 3]" in worked
    assert worked.rstrip().endswith("= 5, the head")


def test_random_cases_fit_and_vary() -> None:
    rng = random.Random(0)
    heads, hits = set(), 0
    for _ in range(100):
        events, num_blocks, bs = prefix_caching._random_events(rng)
        kv = prefix_caching._manager(bs, num_blocks)
        for event in events:
            if event[0] == "add":
                hits += kv.get_computed_blocks("probe", event[2])[1] > 0
                kv.free("probe")
                assert prefix_caching._add(kv, event[1], event[2])
            else:
                kv.free(event[1])
        pool = kv.block_pools[0]
        heads.add(pool.blocks[next(iter(pool.free_queue))].block_hash is not None)
    assert heads == {True, False}  # the next block is sometimes a cached one (an eviction), sometimes not
    assert hits > 30


def test_an_answer_that_raises_on_a_later_case_is_told_about_its_first_wrong_one() -> None:
    """Without hits, random events may not fit: the wrong answer raises there, after a wrong shown case."""

    def no_cache(events: list[tuple[Any, ...]], num_blocks: int, block_size: int) -> int:
        free, held = list(range(1, num_blocks)), {}
        for event in events:
            if event[0] == "add":
                n = -(-len(event[2]) // block_size)
                if n > len(free):
                    raise IndexError("list index out of range")
                held[event[1]], free = free[:n], free[n:]
            else:
                free += held.pop(event[1])[::-1]
        return free[0]

    for _ in range(5):  # the random cases differ every call
        assert_rejected(
            check_next_block(no_cache), "('add', 'B', [1, 2, 3, 4, 5, 6, 7, 8, 60, 61])", "= 2 is not the next block"
        )
    assert_rejected(
        check_hit_length(lambda cached, prompt, bs: [][0]), "fn([[7, 3, 9", "raised IndexError: list index out of range"
    )


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its
    checker; no saved output of the notebook shows a pass mark, so a pass on screen is the student's own."""
    checkers = {"check_hit_length": check_hit_length, "check_next_block": check_next_block}
    assert_worked_solutions_pass("12_prefix_caching.ipynb", 2, checkers)


def test_an_int_that_equals_anything_fails() -> None:
    assert_rejected(check_hit_length(lambda *a: EqualToAnything(0)))  # graded as the 0 it holds
    assert_rejected(check_next_block(lambda *a: EqualToAnything(1)))  # graded as the 1 it holds
