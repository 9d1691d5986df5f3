"""Checkers of notebook 05 (attention groups and metadata): accept a right answer written here, reject wrong ones
with a message that gives the rule and never the right numbers, reject the package's own implementation however it
is reached, and offer reveal() with the worked answer after three wrong tries."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import pagedkv.exercises.attention_groups as attention_groups
from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.exercises import reveal
from pagedkv.exercises.attention_groups import check_lengths, check_null_blocks
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from tests.exercises.checks import assert_rejected, assert_worked_solutions_pass, notebook_cells


def lengths(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    return query_lens, [s - q for s, q in zip(seq_lens, query_lens)]


def null_blocks(context_len: int, sliding_window: int, block_size: int) -> int:
    return max(context_len - sliding_window + 1, 0) // block_size


def test_no_reference_answer_is_importable() -> None:
    for name in ("step_lengths", "sliding_window_rows", "manager_window_rows"):
        assert not hasattr(attention_groups, name)


def test_lengths_right_answers_pass() -> None:
    assert check_lengths(lengths)

    def as_tensors(query_start_loc: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, Any]:
        starts, seqs = torch.tensor(query_start_loc), torch.tensor(seq_lens)
        return starts[1:] - starts[:-1], (seqs - (starts[1:] - starts[:-1])).numpy()

    assert check_lengths(as_tensors)


def test_lengths_wrong_answers_get_the_rule_not_the_numbers() -> None:
    def starts_as_lengths(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
        return query_start_loc[1:], lengths(query_start_loc, seq_lens)[1]  # query_start_loc's entries as lengths

    def seq_as_context(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
        return lengths(query_start_loc, seq_lens)[0], seq_lens

    result = check_lengths(starts_as_lengths)
    assert_rejected(result, "query_lens: entry", "is wrong", "query_start_loc[i + 1] - 1")
    assert "expected" not in result.message
    assert_rejected(check_lengths(seq_as_context), "context_lens: entry", "without this step's query tokens")
    assert_rejected(check_lengths(lambda q, s: 1 / 0), "raised ZeroDivisionError")
    assert_rejected(check_lengths(lambda q, s: 3), "return a pair")


def test_lengths_message_does_not_hold_the_right_numbers() -> None:
    # A batch whose answer can be recognised: every query length is 3, context lengths are 1000 + 7 i.
    calls: list[tuple[list[int], list[int]]] = []

    def off_by_one(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
        calls.append((query_start_loc, seq_lens))
        query_lens, context_lens = lengths(query_start_loc, seq_lens)
        return query_lens, [c + 1 for c in context_lens]

    result = check_lengths(off_by_one)
    assert_rejected(result, "context_lens")
    starts, seqs = calls[0]
    right = lengths(starts, seqs)[1]
    assert str(right) not in result.message and f"expected {right[0]}" not in result.message


def test_lengths_package_is_turned_away() -> None:
    def through_metadata(query_start_loc: list[int], seq_lens: list[int]) -> tuple[Any, Any]:
        starts, seqs = torch.tensor(query_start_loc), torch.tensor(seq_lens)
        cm = CommonAttentionMetadata(
            starts, starts, seqs, seqs, len(seq_lens), int(starts[-1]), 1, 1, torch.zeros(1, 1), torch.zeros(1)
        )
        return cm.query_lens_cpu, cm.context_lens_cpu

    def on_a_thread(query_start_loc: list[int], seq_lens: list[int]) -> Any:
        return ThreadPoolExecutor(max_workers=1).submit(through_metadata, query_start_loc, seq_lens).result()

    def reads_the_checker(query_start_loc: list[int], seq_lens: list[int]) -> Any:
        return sys._getframe(1).f_locals["expected"]

    assert_rejected(check_lengths(through_metadata), "Your answer calls CommonAttentionMetadata.query_lens_cpu")
    assert_rejected(check_lengths(on_a_thread), "Your answer calls CommonAttentionMetadata.query_lens_cpu")
    assert_rejected(check_lengths(reads_the_checker), "reading the checker's frames")
    assert_rejected(check_lengths(CommonAttentionMetadata.query_lens_cpu.fget), "pagedkv's own")


def test_lengths_reveal_after_three_tries(capsys: pytest.CaptureFixture[str]) -> None:
    def swapped(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
        return lengths(query_start_loc, seq_lens)[::-1]

    messages = [check_lengths(swapped).message for _ in range(3)]
    assert "reveal()" not in messages[1] and "reveal()" in messages[2]
    reveal()
    worked = capsys.readouterr().out
    assert "05: query_lens and context_lens" in worked and "request 0: query_len = " in worked
    assert "context_len = seq_len - query_len = " in worked


def test_null_blocks_right_answer_passes() -> None:
    result = check_null_blocks(null_blocks)
    assert result, result.message
    assert "sequences of up to 10^12 tokens" in result.message


@pytest.mark.parametrize(
    ("wrong", "phrases"),
    [
        (lambda c, w, b: (c - w) // b, ["your function says -8", "never a negative number"]),  # the notebook's try
        (lambda c, w, b: max(c - w, 0) // b, ["null block(s), which is not it"]),
        (lambda c, w, b: max(c - 32 + 1, 0) // b, ["null block(s)"]),  # tiny-hybrid's window written in
        (lambda c, w, b: max(c - w + 1, 0) // b if b in (4, 8) and c < 10**5 else 0, ["null block(s)"]),
        (lambda c, w: 0, ["raised TypeError"]),
    ],
)
def test_null_blocks_wrong_answers_get_the_rule(wrong: Any, phrases: list[str]) -> None:
    result = check_null_blocks(wrong)
    assert_rejected(result, *phrases)
    assert "max(" not in result.message and "= " not in result.message  # no worked numbers in the message


def test_null_blocks_package_is_turned_away() -> None:
    def through_a_manager(context_len: int, sliding_window: int, block_size: int) -> int:
        spec = SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=sliding_window
        )
        manager = KVCacheManager(KVCacheConfig(context_len // block_size + 3, [KVCacheGroupSpec(["x"], spec)]))
        manager.allocate_slots("0", 0, context_len)
        manager.allocate_slots("0", context_len, 1)
        return manager.get_block_ids("0")[0].count(0)

    def on_a_thread(context_len: int, sliding_window: int, block_size: int) -> int:
        return (
            ThreadPoolExecutor(max_workers=1)
            .submit(through_a_manager, context_len, sliding_window, block_size)
            .result()
        )

    def reads_the_checker(context_len: int, sliding_window: int, block_size: int) -> int:
        return sys._getframe(1).f_locals["row"].count(0)

    assert_rejected(check_null_blocks(through_a_manager), "Your answer calls KVCacheManager.allocate_slots")
    assert_rejected(check_null_blocks(on_a_thread), "Your answer calls KVCacheManager.allocate_slots")
    assert_rejected(check_null_blocks(reads_the_checker), "reading the checker's frames")
    assert_rejected(check_null_blocks(KVCacheManager._free_out_of_window), "pagedkv's own")


def test_null_blocks_reveal_after_three_tries(capsys: pytest.CaptureFixture[str]) -> None:
    messages = [check_null_blocks(lambda c, w, b: (c - w) // b).message for _ in range(3)]
    assert "reveal()" not in messages[1] and "reveal()" in messages[2]
    reveal()
    worked = capsys.readouterr().out
    assert "context_len = 0, sliding_window = 32, block_size = 4" in worked
    assert "max(0 - 32 + 1, 0) = 0" in worked and "= 0 block(s)" in worked


@pytest.mark.parametrize("block_size, prompt_len", [(4, 40), (5, 57)])
def test_the_planned_schedule_is_the_engines(block_size: int, prompt_len: int) -> None:
    """The checker calls the student's function on context lengths it plans before any engine runs:
    they must be the engine's, and the model-free manager's rows must be the engine's rows."""
    engine = attention_groups._engine_rows(block_size, prompt_len, 16, 16)
    assert [c for c, _ in engine] == attention_groups._schedule(prompt_len, 16, 16)
    assert attention_groups._manager_rows(32, block_size, prompt_len, 16, 16) == engine


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its
    checker; no saved output shows a pass mark, so a pass on screen is the student's own."""
    notebook = "05_attention_groups_and_metadata.ipynb"
    assert_worked_solutions_pass(notebook, 2, {"check_lengths": check_lengths, "check_null_blocks": check_null_blocks})
    cells = notebook_cells(notebook)
    markdown = "\n".join(
        "".join(c["source"])
        for c in cells
        if c["cell_type"] == "markdown" and "Worked solution" not in "".join(c["source"])
    )
    assert "context_len - 32 + 1" not in markdown and "context_len = seq_len - query_len" not in markdown
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code").replace(",\n", ", ")
    assert all("enable_prefix_caching=False" in line for line in source.splitlines() if "LLM(" in line)
