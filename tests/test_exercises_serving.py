"""Checker of notebook 09 (serving) on the notebook's own engine; the right answers are worked out by
hand from the rules (running requests first, chunked prefill), not read from the checker.

The engine runs one step at a time (async_scheduling=False, as in the notebook): the exercise reads
the engine's state between two steps, which async scheduling has moved on already.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.exercises.serving import check_next_schedule
from tests.exercise_checks import assert_rejected

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_next_schedule() -> None:
    # Notebook 09's engine: blocks of 4, 7 usable blocks, 12 tokens per step.
    llm = LLM("tiny", device="cpu", num_kv_blocks=8, block_size=4, max_num_batched_tokens=12, async_scheduling=False)
    for prompt in ["abc", "defgh", "a much longer prompt"]:  # 4, 6 and 21 tokens
        llm.add_request(prompt, GREEDY)
    llm.step()  # 4 + 6 tokens, then the last 2 of the budget go to request 2's first chunk
    # Next: two decodes (1 + 1), request 2 gets the 10 tokens left of the budget (19 remain).
    assert check_next_schedule(llm, {"0": 1, "1": 1, "2": 10}, [])
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1, "2": 19}, []), "request 2", "chunked")
    assert_rejected(check_next_schedule(llm, {"0": 4, "1": 1, "2": 10}, []), "request 0", "decoding")
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1, "2": 10}, ["2"]), "preempted", "found the blocks")
    assert_rejected(check_next_schedule(llm, ...), "Replace `...`")
    assert llm.stats.num_steps == 1
