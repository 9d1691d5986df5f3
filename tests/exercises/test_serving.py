"""Checker of notebook 09 (serving) on the notebook's own engine; the right answers are worked out by
hand from the rules (running requests first, chunked prefill, preemption of the newest), not read from
the checker. A wrong answer is told the rule that decides the request it got wrong, never the number
(the second edition's "expected 10 token(s)" could be copied, issue 32); reveal() works the step out.

The engine runs one step at a time (async_scheduling=False, as in the notebook): the exercise reads
the engine's state between two steps, which async scheduling has moved on already.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.exercises import reveal
from pagedkv.exercises.serving import check_next_schedule
from tests.exercises.checks import (
    EqualToAnything,
    assert_not_answered,
    assert_rejected,
    run_solution,
    saved_outputs_show_no_pass,
    worked_solutions,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def llm() -> LLM:
    """Notebook 09's exercise engine after its first step: blocks of 4, 7 usable blocks, 12 tokens per step."""
    engine = LLM(
        "tiny",
        device="cpu",
        num_kv_blocks=8,
        block_size=4,
        max_num_batched_tokens=12,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    for prompt in ["abc", "defgh", "a much longer prompt"]:  # 4, 6 and 21 tokens
        engine.add_request(prompt, GREEDY)
    engine.step()  # 4 + 6 tokens, then the last 2 of the budget go to request 2's first chunk
    return engine


def test_exercise_1(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    # Next: two decodes (1 + 1), request 2 gets the 10 tokens left of the budget (19 remain).
    whole = check_next_schedule(llm, {"0": 1, "1": 1, "2": 19}, [])
    assert_rejected(whole, "request 2: you wrote 19", "chunked (rule 3)", "subtract what the requests before it take")
    assert "10" not in whole.message and "expected" not in whole.message
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1, "2": 9}, []), "gets all of the budget")
    assert_rejected(check_next_schedule(llm, {"0": 4, "1": 1, "2": 10}, []), "request 0", "decoding")
    third = check_next_schedule(llm, {"0": 1, "1": 1, "2": 10}, ["2"])
    assert_rejected(third, "preempted: ['2'] is not it", "nobody is preempted", "Try 4", "reveal()")
    reveal()
    worked = capsys.readouterr().out
    assert "request 2 (running, 19 to compute, budget 10 at its turn): 10 token(s), chunked" in worked
    assert "= tokens {'0': 1, '1': 1, '2': 10}, preempted []" in worked
    assert check_next_schedule(llm, {"0": 1, "1": 1, "2": 10}, [])
    assert check_next_schedule(llm, {0: 1, 1: 1, 2: 10, 3: 0})  # int ids, a 0 entry, preempted left out
    assert llm.stats.num_steps == 1  # checking does not advance the engine


def test_exercise_2(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.step()  # no free block left; request 2 (9 tokens to go) needs 3 more blocks, and is the newest
    assert check_next_schedule(llm, {"0": 1, "1": 1}, ["2"])
    no_victim = check_next_schedule(llm, {"0": 1, "1": 1, "2": 9}, [])
    assert_rejected(no_victim, "request 2: you wrote 9", "which request gives its blocks back (rule 4)")
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1}, []), "preempted: [] is not it", "needs a new block")
    oldest = check_next_schedule(llm, {"0": 1, "1": 1}, ["1"])
    assert_rejected(oldest, "takes the newest running request", "Try 3")
    reveal()
    worked = capsys.readouterr().out
    assert "request 2 (running, 9 to compute, budget 10 at its turn): preempted" in worked
    assert "preempted ['2']" in worked


def test_an_int_that_equals_anything_fails(llm: LLM) -> None:
    lies = {"0": EqualToAnything(1), "1": EqualToAnything(1), "2": EqualToAnything(1)}
    assert_rejected(check_next_schedule(llm, lies, []), "request 2: you wrote 1")
    llm.step()
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1}, [EqualToAnything(0)]), "preempted: ['0'] is not it")


def test_form_of_the_answer(llm: LLM) -> None:
    assert_not_answered(check_next_schedule(llm, ...))
    assert_rejected(check_next_schedule(llm, [1, 1, 10]), "tokens must be a dict")
    assert_not_answered(check_next_schedule(llm, {"0": 1}, ...))
    assert_rejected(check_next_schedule(llm, {"0": 1}, "2"), "preempted must be a list")
    assert_rejected(check_next_schedule(llm, {"0": 1, "1": 1, "2": 10, "7": 2}), "request 7 is neither running")
    assert_rejected(check_next_schedule(llm, {"zero": 1}), "Request ids are numbers")


def test_the_notebooks_worked_solutions_pass_and_are_not_run(llm: LLM) -> None:
    solutions = worked_solutions("09_serving_end_to_end.ipynb")
    assert len(solutions) == 2
    for code in solutions:  # exercise 1, then one more step, exercise 2 (as in the notebook)
        assert run_solution(code, {"check_next_schedule": check_next_schedule, "ex": llm})
        llm.step()
    assert saved_outputs_show_no_pass("09_serving_end_to_end.ipynb")
