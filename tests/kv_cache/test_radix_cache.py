"""The radix-tree prefix cache (SGLang's idea) against trees and eviction orders worked out by hand:
edges split where prefixes diverge, the longest match token by token, locked paths never evicted,
least recently used leaves evicted whole, and the pool's token accounting."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache.radix_cache import EvictedTokens, RadixCache


def edges(cache: RadixCache) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every node as (the prefix above its edge, its edge's tokens)."""
    return {(node.token_ids()[: -len(node.key)], node.key) for node in cache.nodes()}


def test_insert_splits_an_edge_where_two_sequences_diverge() -> None:
    cache = RadixCache(100)
    assert cache.insert([1, 2, 3, 4, 5]) == 0
    assert cache.insert([1, 2, 3, 9, 9]) == 3  # 1 2 3 cached already
    #   root ─ (1 2 3) ─┬─ (4 5)
    #                   └─ (9 9)
    assert edges(cache) == {((), (1, 2, 3)), ((1, 2, 3), (4, 5)), ((1, 2, 3), (9, 9))}
    assert cache.num_cached_tokens == 7
    assert cache.insert([1, 2, 3, 4, 5]) == 5 and cache.num_cached_tokens == 7  # nothing new
    assert cache.insert([1, 2, 3, 4]) == 4  # ends on a split, adds nothing
    assert ((1, 2, 3), (4,)) in edges(cache) and ((1, 2, 3, 4), (5,)) in edges(cache)
    assert cache.num_cached_tokens == 7


def test_match_is_token_granular_and_splits_the_edge_it_ends_in() -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3, 4, 5, 6])
    length, node = cache.match_prefix([1, 2, 3, 7])
    assert length == 3 and node.token_ids() == (1, 2, 3)  # not rounded down to any block
    assert edges(cache) == {((), (1, 2, 3)), ((1, 2, 3), (4, 5, 6))}
    assert cache.match_prefix([9, 1])[0] == 0
    length, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert length == 6 and node.token_ids() == (1, 2, 3, 4, 5, 6)
    assert cache.num_cached_tokens == 6  # a split moves tokens, it adds none


def test_eviction_takes_the_least_recently_used_leaf_whole() -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3, 4])  # clock 1
    cache.insert([1, 2, 5, 6])  # clock 2: splits (1 2 3 4) into (1 2) + (3 4)
    cache.insert([7, 8])  # clock 3
    cache.match_prefix([1, 2, 3, 4])  # clock 4: (1 2) and (3 4) used now
    # Leaves by last use: (5 6) at 2, (7 8) at 3, (3 4) at 4.
    assert cache.evict(1) == [EvictedTokens((1, 2, 5, 6), 2)]  # 1 asked, the whole leaf (2) goes
    assert cache.evict(1) == [EvictedTokens((7, 8), 0)]
    # (3 4) goes, then its parent (1 2), now a leaf, joins the candidates of the same call.
    assert cache.evict(3) == [EvictedTokens((1, 2, 3, 4), 2), EvictedTokens((1, 2), 0)]
    assert cache.num_cached_tokens == 0 and not cache.root.children
    assert cache.evict(1) == []


def test_a_locked_path_is_never_evicted() -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6])
    _, node = cache.match_prefix([1, 2, 3, 4])  # the newest: it would go last anyway
    cache.insert([5, 6, 7])  # (5 6 7) is now newer than (1 2 3 4)
    cache.lock(node)
    assert [e.token_ids for e in cache.evict(100)] == [(5, 6, 7), (5, 6)]  # never (1 2 3 4)
    assert cache.num_cached_tokens == 4
    cache.unlock(node)
    assert cache.evict(100) == [EvictedTokens((1, 2, 3, 4), 0)]
    with pytest.raises(RuntimeError, match="unlocked more often than locked"):
        cache.unlock(node)


def test_a_split_keeps_the_lock_on_both_halves() -> None:
    cache = RadixCache(100)
    cache.insert([1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.lock(node)
    cache.insert([1, 2, 9])  # splits the locked edge: (1 2) and (3 4) are both read by the request
    assert cache.evict(100) == [EvictedTokens((1, 2, 9), 2)]
    cache.unlock(node)  # walks (3 4) then (1 2): both unlocked again
    assert [e.token_ids for e in cache.evict(100)] == [(1, 2, 3, 4), (1, 2)]


def test_requests_reserve_their_tokens_and_hand_them_to_the_tree() -> None:
    cache = RadixCache(10)
    admitted = cache.start([1, 2, 3, 4], 6)  # a prompt of 4 that will hold 6 tokens' K/V
    assert admitted is not None
    first, evicted = admitted
    assert (first.num_hit, first.num_reserved, evicted) == (0, 6, [])
    assert cache.num_free_tokens == 4
    cache.finish(first, [1, 2, 3, 4, 5, 6])
    assert (cache.num_cached_tokens, cache.num_reserved_tokens, cache.num_free_tokens) == (6, 0, 4)

    # The whole prompt is cached, yet its last token is never looked up: 3 found, not 4.
    admitted = cache.start([1, 2, 3, 4], 5)
    assert admitted is not None
    again, _ = admitted
    assert (again.num_hit, again.num_reserved) == (3, 2)
    # The request locks the path to its hit, (1 2 3); the leaf below it, (4 5 6), may go.
    assert cache.evict(100) == [EvictedTokens((1, 2, 3, 4, 5, 6), 3)]
    cache.finish(again, [1, 2, 3, 4, 5])  # its own 4 5 become the leaf
    assert (cache.num_cached_tokens, cache.num_reserved_tokens) == (5, 0)

    # 8 new tokens beside 5 cached ones in a pool of 10: 3 must go; the leaf (4 5) frees 2, then
    # its parent (1 2 3), a leaf now, goes whole.
    third = cache.start([7, 8, 9], 8)
    assert third is not None
    assert third[1] == [EvictedTokens((1, 2, 3, 4, 5), 3), EvictedTokens((1, 2, 3), 0)]
    assert cache.num_free_tokens == 2
    assert cache.start([1, 2], 11) is None  # too long even for an emptied cache: refused
    cache.finish(third[0], [7, 8, 9, 10, 11, 12, 13, 14])
    assert cache.num_cached_tokens == 8
    assert cache.evict(100) == [EvictedTokens((7, 8, 9, 10, 11, 12, 13, 14), 0)]


def test_a_running_request_keeps_its_prefix_while_others_need_room() -> None:
    cache = RadixCache(12)
    cache.insert([1, 2, 3, 4, 5, 6])
    admitted = cache.start([1, 2, 3, 4, 9], 6)  # finds 1 2 3 4, reserves 2 more
    assert admitted is not None
    running, _ = admitted
    assert cache.num_free_tokens == 4
    # 7 are needed, 4 free: the only unlocked leaf, (5 6), frees 2, and nothing else may go.
    assert cache.start([20, 21, 22, 23, 24], 7) is None
    assert edges(cache) == {((), (1, 2, 3, 4))}
    assert cache.num_free_tokens == 6
    cache.finish(running, [1, 2, 3, 4, 9, 10])
    assert edges(cache) == {((), (1, 2, 3, 4)), ((1, 2, 3, 4), (9, 10))}
    assert (cache.num_cached_tokens, cache.num_free_tokens) == (6, 6)
