"""Notebook 12's checkers accept right answers (written here from the rules, not from the package)
and reject wrong ones and answers that call the package's manager, pool or hash functions."""

from __future__ import annotations

import functools
import math
import random
from collections import OrderedDict
from typing import Any

import pytest

from pagedkv.exercises import prefix_caching
from pagedkv.exercises.prefix_caching import (
    RULE_CASES, SHOWN_EVICTION_CASES, SHOWN_HIT_CASES, check_hit_length, check_next_block,
)
from pagedkv.kv_cache.block_pool import hash_request_blocks
from pagedkv.kv_cache.manager import KVCacheManager


def right_hit_length(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    usable = (len(prompt) - 1) // block_size  # the last token is always computed
    best = 0
    for cached in cached_prompts:
        n = 0
        while (n < min(len(cached) // block_size, usable)
               and cached[n * block_size:(n + 1) * block_size] == prompt[n * block_size:(n + 1) * block_size]):
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
            block = block_of.get(tuple(tokens[:(j + 1) * block_size]))
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
            key = tuple(tokens[:(j + 1) * block_size])
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
        return max(next((i for i, (a, b) in enumerate(zip(c, prompt)) if a != b), min(len(c), len(prompt)))
                   for c in cached_prompts)

    def without_last_token_rule(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return right_hit_length(cached_prompts, [*prompt, -1], block_size)

    def first_prompt_only(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        return right_hit_length(cached_prompts[:1], prompt, block_size)

    result = check_hit_length(common_tokens)
    assert not result and "whole blocks" in result.message and "fn([[7, 3, 9" in result.message
    result = check_hit_length(without_last_token_rule)
    assert not result and "last prompt token is always computed" in result.message
    result = check_hit_length(first_prompt_only)
    assert not result and "expected 12" in result.message  # the fifth shown case: the second prompt matches more
    assert not check_hit_length(lambda *args: "8") and not check_hit_length(lambda *args: 1 / 0)
    assert not check_hit_length(8)


def test_hit_length_rejects_the_package() -> None:
    def by_hashes(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
        known = {h for c in cached_prompts for h in hash_request_blocks(c, block_size)}
        hashes = hash_request_blocks(prompt, block_size)[: (len(prompt) - 1) // block_size]
        return next((i for i, h in enumerate(hashes) if h not in known), len(hashes)) * block_size

    result = check_hit_length(by_hashes)
    assert not result and "pagedkv's own hash_request_blocks" in result.message
    result = check_hit_length(prefix_caching.expected_hit_length)
    assert not result and "pagedkv's own" in result.message
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
        unique = [(e[0], e[1], [-1000 * k - i for i in range(len(e[2]))]) if e[0] == "add" else e
                  for k, e in enumerate(events)]
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

    result = check_next_block(ignores_hits)
    assert not result and "expected 5" in result.message and "the free queue is then [5, 3]" in result.message
    result = check_next_block(frees_first_block_first)
    assert not result and "last block first" in result.message
    assert not check_next_block(lambda events, n, bs: None)


def test_next_block_rejects_the_package() -> None:
    result = check_next_block(lambda events, n, bs: prefix_caching.replay(events, n, bs)[0])
    assert not result and "pagedkv's own" in result.message


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
