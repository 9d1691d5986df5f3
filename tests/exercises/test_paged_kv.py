"""Checkers of notebook 02 (paged KV cache) on the notebook's own engine; the right answers are worked
out by hand from the rules (block pool order, slot = block * block_size + offset), not read from the checkers.
A wrong answer is told which rule it broke, never the right number; copying the numbers of a message does
not pass; an answer object whose == reads the checker's frames is not accepted as a number.

The engine runs one step at a time (async_scheduling=False, as in the notebook): the exercises read
the engine's state between two steps, which async scheduling has moved on already.
"""

from __future__ import annotations

import re
import sys

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.exercises import paged_kv, reveal
from pagedkv.exercises.paged_kv import check_blocks_held, check_next_slot_mapping
from tests.exercises.checks import ListEqualToAnything, assert_rejected, revealed

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
RIGHT_SLOTS = [28, 17, 27]
"""Rows after the prefill: [1, 2], [3, 4], [5, 6] (the free queue hands out 1, 2, 3, ... in order).
Decode positions 8, 5, 7: request 0 needs a third block, 7 (head of the free queue): slot 28;
request 1: block 4, offset 1 -> 17; request 2: block 6, offset 3 -> 27."""


@pytest.fixture
def paged() -> LLM:
    """Notebook 02's exercise engine: blocks of 4, three prompts prefilled in one step."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, block_size=4, async_scheduling=False, enable_prefix_caching=False)
    for prompt in ["blocks!", "slot", "paging"]:  # 8, 5 and 7 tokens with the begin-of-sequence token
        llm.add_request(prompt, GREEDY)
    llm.step()
    return llm


class FrameReader(int):
    """A number whose == looks up the stack for the checker's answer: equal to whatever it finds."""

    def __eq__(self, other: object) -> bool:
        frame = sys._getframe(1)
        return frame is not None

    __hash__ = int.__hash__


def numbers_in(message: str) -> set[int]:
    """The numbers a message shows (not the count of tries)."""
    return {int(n) for n in re.findall(r"\d+", message.split(" (Try ")[0])}


def test_blocks_held(paged: LLM) -> None:
    # Request 1: 5 tokens in the cache -> ceil(5 / 4) = 2 blocks, 8 - 5 = 3 empty slots.
    assert check_blocks_held(paged, "1", 2, 3)
    for (blocks, empty), phrase in [
        ((1, 3), "round up"),  # floor(5 / 4)
        ((3, 3), "ceil(tokens in the cache / block_size)"),
        ((2, 2), "sampled last"),  # counted the 6th token, not in the cache yet
        ((2, 0), "only the last block"),
    ]:
        result, work = revealed(lambda b=blocks, e=empty: check_blocks_held(paged, "1", b, e))
        assert_rejected(result, phrase)
        assert "expected" not in result.message
        wrong_part = "blocks" if blocks != 2 else "slots"
        assert (2 if wrong_part == "blocks" else 3) not in numbers_in(result.message) - {blocks, empty}
        assert "ceil(5 / 4) = 2 blocks" in work and "so 3 empty" in work
    assert_rejected(check_blocks_held(paged, "1", 2.0, 3), "ints")
    assert_rejected(
        check_blocks_held(paged, "1", FrameReader(7), FrameReader(7)), "is not it"
    )  # graded as the 7 it holds
    assert_rejected(check_blocks_held(paged, "9", 2, 3), "not running")


def test_next_slot_mapping(paged: LLM) -> None:
    assert check_next_slot_mapping(paged, RIGHT_SLOTS)
    for wrong, phrase in [
        ([8, 5, 7], "position used directly"),
        ([7, 17, 27], "physical block id"),
        ([24, 17, 27], "does not fit the blocks the request held"),
        ([28, 16, 27], "add the token's offset"),
        ([28, 17, 26], "wrong offset"),
        ([28, 18, 27], "one position too far"),
    ]:
        result, work = revealed(lambda w=wrong: check_next_slot_mapping(paged, w))
        assert_rejected(result, phrase)
        i = next(i for i, (a, b) in enumerate(zip(wrong, RIGHT_SLOTS)) if a != b)
        assert RIGHT_SLOTS[i] not in numbers_in(result.message), result.message
        assert f"= {RIGHT_SLOTS[i]}" in work
    assert_rejected(check_next_slot_mapping(paged, [28, 17]), "3 token(s)")
    assert_rejected(check_next_slot_mapping(paged, "28, 17, 27"), "a list of slot numbers")
    assert paged.stats.num_steps == 1  # checking does not advance the engine


def test_next_slot_mapping_copying_the_messages_numbers_does_not_pass(paged: LLM) -> None:
    # For each entry, a guess there (the others right), then every number its message shows: none passes.
    for i in range(3):
        guess = [*RIGHT_SLOTS[:i], 0, *RIGHT_SLOTS[i + 1 :]]
        result = check_next_slot_mapping(paged, guess)
        assert_rejected(result, f"entry {i}")
        for n in numbers_in(result.message):
            assert not check_next_slot_mapping(paged, [*RIGHT_SLOTS[:i], n, *RIGHT_SLOTS[i + 1 :]])


def test_next_slot_mapping_is_not_fooled_by_an_answer_that_reads_frames(paged: LLM) -> None:
    assert_rejected(check_next_slot_mapping(paged, [FrameReader(0)] * 3), "is not it")
    assert_rejected(check_next_slot_mapping(paged, ListEqualToAnything([0, 0, 0])), "0 is not it")


def test_no_reference_answer_to_import() -> None:
    assert not [name for name in vars(paged_kv) if "expected" in name or "token" in name.lower()]


def test_next_slot_mapping_offers_reveal_after_three_tries(paged: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_next_slot_mapping(paged, RIGHT_SLOTS)  # a pass resets the count
    messages = [check_next_slot_mapping(paged, [8, 5, 7]).message for _ in range(3)]
    assert "reveal()" not in messages[1] and "Stuck? `reveal()`" in messages[2]
    reveal()
    shown = capsys.readouterr().out
    assert shown.startswith("02: the next step's slot mapping, worked out:")
    assert (
        "request 0, position 8: logical block 8 // 4 = 2, physical block row[2] = 7 (its row held 2 block(s), "
        "so this step first takes block 7 from the head of the free queue), offset 8 % 4 = 0, "
        "slot 7 * 4 + 0 = 28"
    ) in shown
