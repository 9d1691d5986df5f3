"""Automatic prefix caching: block hashes, hits counted by hand, eviction order, no leaks, and
the engine's outputs and logits unchanged by it (against the float64 transformers reference).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.kv_cache.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import FullAttentionSpec, get_kv_cache_config
from tests.conftest import needs_triton_on_cpu
from tests.reference import generate_checked

BS = 4
SPEC = FullAttentionSpec(BS, 1, 8, torch.float32)


def manager(num_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(get_kv_cache_config({"l0": SPEC}, num_blocks=num_blocks), enable_caching=True)


def run(kv: KVCacheManager, req: str, tokens: list[int]) -> int:
    """Admit a request as the scheduler does (look up, then allocate the rest); the hit length."""
    hits, num_hit = kv.get_computed_blocks(req, tokens)
    assert kv.allocate_slots(req, num_hit, len(tokens) - num_hit, hits, token_ids=tokens)
    return num_hit


def test_hash_chain() -> None:
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    h0 = hash_block_tokens(None, a)
    assert h0 == hash_block_tokens(None, list(a)) and h0 != hash_block_tokens(None, b)
    assert hash_block_tokens(h0, b) != hash_block_tokens(None, b)  # a block's hash covers its whole prefix
    assert hash_request_blocks(a + b + [9], BS) == [h0, hash_block_tokens(h0, b)]  # full blocks only
    assert hash_block_tokens(None, a, ("lora-1",)) != h0


@pytest.mark.parametrize(
    "second,expected_hit",
    [
        (list(range(10)), 8),  # same 10-token prompt: its two full blocks
        (list(range(8)), 4),  # equal to a cached 8-token prompt: the last token is computed again
        (list(range(9)), 8),  # one token longer: both blocks
        (list(range(6)) + [99, 98, 97], 4),  # diverges inside block 1: only block 0
        ([99] + list(range(1, 10)), 0),  # diverges in the first token: nothing
        ([4, 5, 6, 7, 50, 51], 0),  # A's block 1 tokens at B's start: another prefix, so another hash
    ],
)
def test_hit_lengths_by_hand(second: list[int], expected_hit: int) -> None:
    kv = manager()
    run(kv, "A", list(range(10)))  # blocks [0:4], [4:8] full and cached; [8:10] partial
    assert run(kv, "B", second) == expected_hit
    rows = kv.get_block_ids("A")[0], kv.get_block_ids("B")[0]
    assert rows[1][: expected_hit // BS] == rows[0][: expected_hit // BS]  # the very same blocks
    shared = kv.block_pools[0].blocks[rows[0][0]]
    assert shared.ref_cnt == (2 if expected_hit else 1)


def test_freed_blocks_stay_cached_and_are_evicted_deepest_first() -> None:
    kv = manager(num_blocks=8)  # 7 usable
    run(kv, "A", list(range(12)))  # 3 full blocks
    a_blocks = kv.get_block_ids("A")[0]
    kv.free("A")
    pool = kv.block_pools[0]
    assert list(pool.free_queue)[-3:] == a_blocks[::-1]  # the deepest block is first in line for eviction
    assert len(pool.cached_block_hash_to_block) == 3 and pool.num_free_blocks == 7
    assert run(kv, "B", list(range(12)) + [50]) == 12  # found again after A finished
    assert [b for b in kv.get_block_ids("B")[0][:3]] == a_blocks and pool.num_free_blocks == 3
    kv.free("B")
    # Fill the cache with other requests: the never-cached blocks go first, then A's last block, ...
    run(kv, "C", [70 + i for i in range(16)])  # 4 new blocks: the 3 untouched + B's partial one
    assert len(pool.cached_block_hash_to_block) == 3 + 4  # C's four full blocks cached too, none of A's evicted
    kv.free("C")
    run(kv, "D", [200 + i for i in range(5)])  # 2 blocks from the head of the queue
    evicted = {pool.blocks[b].block_id for b in kv.get_block_ids("D")[0]}
    assert evicted == {kv_id for kv_id in a_blocks[::-1][:2]}  # A's two deepest blocks, evicted first
    assert run(kv, "E", list(range(12)) + [50]) == 4  # only A's first block is still cached


def test_touch_takes_a_cached_free_block_out_of_the_queue() -> None:
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"h"])
    pool.free_blocks([block])
    assert block.block_id in pool.free_queue and pool.get_cached_block(b"h") is block
    pool.touch([block])
    assert block.block_id not in pool.free_queue and block.ref_cnt == 1
    pool.free_blocks([block])
    others = pool.get_new_blocks(3)  # the whole queue: the cached block is evicted last, its hash dropped
    assert others[-1] is block and block.block_hash is None and pool.get_cached_block(b"h") is None


def assert_pool_consistent(llm: LLM) -> None:
    """After a run: every block free, ref counts zero, the hash map and the blocks' hashes agree."""
    for pool in llm.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        assert all(
            pool.blocks[b.block_id] is b and b.block_hash == h for h, b in pool.cached_block_hash_to_block.items()
        )
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)
    assert not llm.kv_cache_manager.req_to_block_hashes


def shared_prefix_prompts(seed: int, n: int = 6) -> list[dict[str, list[int]]]:
    """Random prompts built from two shared system prompts plus random suffixes (some empty)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(rng.randint(5, 14))] for _ in range(2)]
    return [
        {"prompt_token_ids": rng.choice(systems) + [rng.randrange(1, 250) for _ in range(rng.randint(0, 9))]}
        for _ in range(n)
    ]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_identical_with_and_without_caching_under_preemption_and_chunks(seed: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = shared_prefix_prompts(seed)
    engine = dict(
        device="cpu", block_size=BS, num_kv_blocks=14, max_num_batched_tokens=10, attention_backend="TORCH_REF"
    )
    cached = LLM("tiny", enable_prefix_caching=True, **engine)
    outs = generate_checked(cached, prompts, params)  # logits checked against float64 transformers
    plain = LLM("tiny", enable_prefix_caching=False, **engine)
    assert tokens(outs) == tokens(plain.generate(prompts, params, use_tqdm=False))
    assert cached.stats.num_cached_tokens > 0 and cached.stats.num_preemptions > 0
    assert plain.stats.num_cached_tokens == 0
    assert_pool_consistent(cached)


def test_cached_tokens_counted_as_predicted() -> None:
    """A 13-token prompt, then the same prompt + 5 tokens, then the first again (blocks of 4)."""
    llm = LLM("tiny", device="cpu", block_size=BS, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = list(range(1, 14))
    runs = [first, first + [20, 21, 22, 23, 24], first]
    hits = []
    for prompt in runs:
        before = llm.stats.num_cached_tokens
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        hits.append(llm.stats.num_cached_tokens - before)
    # 13 tokens + 3 generated (2 computed before finishing): blocks [0:4] [4:8] [8:12] full.
    assert hits == [0, 12, 12]
    assert llm.stats.num_lookup_tokens == 13 + 18 + 13
    assert llm.stats.prefix_cache_hit_rate == pytest.approx(24 / 44)
    assert_pool_consistent(llm)


@pytest.mark.slow
@needs_triton_on_cpu("TRITON_ATTN")
def test_triton_attn_with_caching_matches_the_reference_and_the_uncached_run() -> None:
    pytest.importorskip("triton")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = dict(
        device="cpu", block_size=BS, num_kv_blocks=24, max_num_batched_tokens=12, attention_backend="TRITON_ATTN"
    )
    prompts = shared_prefix_prompts(3, n=4)
    llm = LLM("tiny", **engine)
    outs = generate_checked(llm, prompts, params)
    assert llm.stats.num_cached_tokens > 0
    assert_pool_consistent(llm)
    plain = LLM("tiny", enable_prefix_caching=False, **engine)
    assert tokens(outs) == tokens(plain.generate(prompts, params, use_tqdm=False))


def test_sliding_window_models_turn_caching_off_or_refuse(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        llm = LLM("tiny-hybrid", device="cpu", num_kv_blocks=16)
    assert not llm.prefix_caching and "Prefix caching is off" in caplog.text and "sliding-window" in caplog.text
    with pytest.raises(ValueError, match="enable_prefix_caching=True: prefix caching is not supported"):
        LLM("tiny-hybrid", device="cpu", num_kv_blocks=16, enable_prefix_caching=True)
    assert LLM("tiny", device="cpu", num_kv_blocks=16).prefix_caching  # on by default


def test_a_block_filled_by_a_later_chunk_is_cached_too() -> None:
    """A prefill chunk that ends inside block 2 leaves it unhashed; the chunk that fills it hashes it."""
    kv, tokens = manager(), list(range(13))
    assert kv.allocate_slots("A", 0, 10, token_ids=tokens)  # blocks 0, 1 full; block 2 half
    assert kv.allocate_slots("A", 10, 3, token_ids=tokens)  # block 2 full now
    assert run(kv, "B", tokens + [99]) == 12  # all three full blocks are found


def test_a_request_recomputed_after_its_blocks_were_evicted_caches_them_again() -> None:
    kv, a = manager(num_blocks=5), list(range(12))
    run(kv, "A", a)
    kv.free("A")  # preempted: its 3 full blocks stay cached, free
    run(kv, "C", list(range(100, 116)))  # takes all 4 usable blocks: A's are evicted
    kv.free("C")
    assert run(kv, "A", a) == 0  # A resumes and computes everything again...
    kv.free("A")
    assert run(kv, "B", a + [50]) == 12  # ...and its blocks are in the cache once more
