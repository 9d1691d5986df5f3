"""Checkers of notebook 02 (paged KV cache) on the notebook's own engine; the right answers are worked
out by hand from the rules (block pool order, slot = block * block_size + offset), not read from the checkers.

The engine runs one step at a time (async_scheduling=False, as in the notebook): the exercises read
the engine's state between two steps, which async scheduling has moved on already.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.exercises.paged_kv import check_blocks_held, check_next_slot_mapping
from tests.exercise_checks import assert_rejected

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def paged() -> LLM:
    """Notebook 02's exercise engine: blocks of 4, three prompts prefilled in one step."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, block_size=4, async_scheduling=False)
    for prompt in ["blocks!", "slot", "paging"]:  # 8, 5 and 7 tokens with the begin-of-sequence token
        llm.add_request(prompt, GREEDY)
    llm.step()
    return llm


def test_blocks_held(paged: LLM) -> None:
    # Request 1: 5 tokens in the cache -> ceil(5 / 4) = 2 blocks, 8 - 5 = 3 empty slots.
    assert check_blocks_held(paged, "1", 2, 3)
    assert_rejected(check_blocks_held(paged, "1", 1, 3), "ceil(5 / 4) = 2")
    assert_rejected(check_blocks_held(paged, "1", 2, 0), "only the last block")
    assert_rejected(check_blocks_held(paged, "1", ..., ...), "Replace both")
    assert_rejected(check_blocks_held(paged, "9", 2, 3), "not running")


def test_next_slot_mapping(paged: LLM) -> None:
    # Rows after the prefill: [1, 2], [3, 4], [5, 6] (the free queue hands out 1, 2, 3, ... in order).
    # Decode positions 8, 5, 7: request 0 needs a third block, 7 (head of the free queue): slot 28;
    # request 1: block 4, offset 1 -> 17; request 2: block 6, offset 3 -> 27.
    assert check_next_slot_mapping(paged, [28, 17, 27])
    assert_rejected(check_next_slot_mapping(paged, [8, 5, 7]), "That is the position itself")
    assert_rejected(check_next_slot_mapping(paged, [7, 17, 27]), "That is the block id")
    assert_rejected(check_next_slot_mapping(paged, [8, 17, 27]), "first takes a new block")
    assert_rejected(check_next_slot_mapping(paged, [28, 17]), "3 token(s)")
    assert_rejected(check_next_slot_mapping(paged, ...), "Replace `...`")
    assert paged.stats.num_steps == 1  # checking does not advance the engine
