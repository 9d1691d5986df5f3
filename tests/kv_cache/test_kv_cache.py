"""Block pool invariants, the KV cache manager, slot mappings and block-table rewrites."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.kv_cache.block_pool import BlockPool
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config
from pagedkv.worker.attn_utils import AttentionGroup
from pagedkv.worker.input_batch import compute_slot_mapping

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 20)), max_size=60))
def test_manager_never_hands_out_a_block_twice(ops: list[tuple[bool, int, int]]) -> None:
    """Random allocate/free over 8 request ids: blocks are owned by one request at a time."""
    manager = KVCacheManager(get_kv_cache_config({"l0": FULL}, num_blocks=24))
    computed: dict[str, int] = {}
    for is_free, rid, n in ops:
        req = str(rid)
        if is_free:
            manager.free(req)
            computed.pop(req, None)
            continue
        if manager.allocate_slots(req, computed.get(req, 0), n):
            computed[req] = computed.get(req, 0) + n
        owned = [b for rows in manager.req_to_blocks.values() for b in rows[0]]
        ids = [b.block_id for b in owned]
        assert len(ids) == len(set(ids)), "a block is in two block tables"
        assert 0 not in ids, "the null block was handed out"
        assert set(ids).isdisjoint(manager.block_pools[0].free_queue)
        assert len(ids) + manager.num_free_blocks() == 23
        for req_id, n_tokens in computed.items():
            assert len(manager.req_to_blocks[req_id][0]) == -(-n_tokens // 4)
    for req in list(manager.req_to_blocks):
        manager.free(req)
    assert manager.num_free_blocks() == 23
    assert all(b.ref_cnt == 0 for b in manager.block_pools[0].blocks[1:])


def test_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(get_kv_cache_config({"l0": FULL}, num_blocks=4))
    assert manager.allocate_slots("a", 0, 9)  # 3 blocks
    assert not manager.allocate_slots("b", 0, 5)  # needs 2, 0 free
    assert manager.get_block_ids("b") == [[]] and manager.num_free_blocks() == 0


def test_block_pool_ref_counts_and_queue_order() -> None:
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (1, 2) and pool.get_usage() == 0.5
    pool.touch([a])  # shared by a second owner
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and list(pool.free_queue) == [3, 4, 2]  # freed blocks go to the tail
    pool.free_blocks([a])
    assert list(pool.free_queue) == [3, 4, 2, 1]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="Cannot get 5 free blocks"):
        pool.get_new_blocks(5)


def test_sliding_window_group_swaps_old_blocks_for_null_block() -> None:
    window = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=6)
    manager = KVCacheManager(get_kv_cache_config({"full": FULL, "swa": window}, num_blocks=10))
    assert manager.allocate_slots("r", 0, 16)
    assert manager.get_block_ids("r") == [[1, 2, 3, 4], [1, 2, 3, 4]]
    # Next step queries position 16, which sees keys 11..16: blocks 0 and 1 (positions 0-7) are out.
    assert manager.allocate_slots("r", 16, 1)
    full_row, swa_row = manager.get_block_ids("r")
    assert full_row == [1, 2, 3, 4, 5]
    assert swa_row[:2] == [0, 0] and swa_row[2:4] == [3, 4] and len(swa_row) == 5
    assert manager.num_free_blocks(1) == 9 - 3


def test_a_window_block_is_given_back_in_the_first_step_no_query_sees_it() -> None:
    window = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=6)
    manager = KVCacheManager(get_kv_cache_config({"full": FULL, "swa": window}, num_blocks=10))
    assert manager.allocate_slots("r", 0, 13) and manager.allocate_slots("r", 13, 1)
    # The step's query sits at 13 and sees keys 8..13 (13 - k < 6): positions 0-7, blocks 0 and 1, are out.
    assert manager.get_block_ids("r")[1][:3] == [0, 0, 3]


def test_slot_mapping_hand_worked() -> None:
    # Request 0 holds blocks [3, 8], request 1 holds [2], request 2 holds [5]; block_size 4.
    table = torch.tensor([[3, 8], [2, 0], [5, 0]], dtype=torch.int32)
    req = torch.tensor([0, 1, 2, 2, 2])
    pos = torch.tensor([5, 2, 0, 1, 2])
    slots = compute_slot_mapping(table, req, pos, block_size=4, num_padded_tokens=7)
    # 8*4+1, 2*4+2, 5*4+0, 5*4+1, 5*4+2, then two padding slots
    assert slots.tolist() == [33, 10, 20, 21, 22, -1, -1]


def test_block_table_rewritten_into_kernel_blocks() -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float32)
    group = AttentionGroup(
        backend=None,
        layer_names=[],
        kv_cache_spec=spec,
        kv_cache_group_id=0,  # type: ignore[arg-type]
        num_heads=1,
        kernel_block_size=16,
    )
    table = torch.tensor([[7, 2], [4, 0]], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2]),
        query_start_loc_cpu=torch.tensor([0, 1, 2]),
        seq_lens=torch.tensor([40, 3]),
        seq_lens_cpu=torch.tensor([40, 3]),
        num_reqs=2,
        num_actual_tokens=2,
        max_query_len=1,
        max_seq_len=40,
        block_table_tensor=table,
        slot_mapping=torch.tensor([2 * 32 + 7, 4 * 32 + 2]),
    )
    rewritten = group._to_kernel_blocks(common).block_table_tensor
    assert rewritten.tolist() == [[14, 15, 4, 5], [8, 9, 0, 1]]
    # The same slot, read through either table, is the same cache position.
    pos = 39  # request 0, manager block 1 (id 2), offset 7
    assert table[0, pos // 32] * 32 + pos % 32 == rewritten[0, pos // 16] * 16 + pos % 16
