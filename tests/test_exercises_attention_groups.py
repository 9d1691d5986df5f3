"""Checker of notebook 05 (attention groups and metadata): accepts a right answer written here, rejects wrong ones with a
message that says what is wrong, and rejects the package's own implementation handed back or called."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.attention.layer import get_attention_context
from pagedkv.attention.selector import get_attn_backend, unregister_backend
from pagedkv.exercises import CheckResult
from tests.exercise_checks import assert_rejected
from pagedkv.exercises.attention_groups import (
    check_lengths,
    check_null_blocks,
    manager_window_rows,
    sliding_window_rows,
    step_lengths,
)
from pagedkv.exercises.backends import check_backend
from pagedkv.exercises.environment import check_choose_backend, environment_report, runs_here
from pagedkv.workbook import list_notebooks
from pagedkv.exercises.forward_context import check_attention_context
from pagedkv.exercises.flash_attention import check_kernel_block_rows
from pagedkv.exercises.model_file import MODEL_HEADS, TP_SIZES, build_attention, check_head_layout, check_qkv_width
from pagedkv.models.layers import head_layout
from pagedkv.forward_context import get_forward_context
from pagedkv.worker.attn_utils import to_kernel_block_table


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", num_kv_blocks=32)




def test_lengths() -> None:
    llm = LLM("tiny-hybrid", device="cpu", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    events: list[Any] = []
    llm.add_step_listener(events.append)
    llm.generate([{"prompt_token_ids": list(range(1, 6))}, {"prompt_token_ids": list(range(1, 12))}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    event = events[1]  # a decode of request 0 and a prefill chunk of request 1
    expected = step_lengths(event)
    assert expected["query_lens"] == [1, 7] and expected["context_lens"] == [5, 3]
    assert check_lengths(event, query_lens=[1, 7], context_lens=(5, 3))
    assert check_lengths(event, query_lens=torch.tensor([1, 7]), context_lens=np.array([5, 3]))  # was a crash
    assert_rejected(check_lengths(event, query_lens=[1, 8], context_lens=[5, 3]), "query_lens", "entry 1 is 8")
    assert_rejected(check_lengths(event, query_lens=[1, 7], context_lens=[6, 10]),
                    "context_lens", "seq_len - query_len")


def test_null_blocks() -> None:
    assert check_null_blocks(lambda c, w, b: max(c - w + 1, 0) // b)
    assert_rejected(check_null_blocks(lambda c, w, b: (c - w) // b), "your function says -8", "max(")
    assert_rejected(check_null_blocks(lambda c, w, b: max(c - w, 0) // b), "null block(s)")
    assert_rejected(check_null_blocks(lambda c, w: 0), "raised TypeError")


def test_null_blocks_has_a_random_block_size() -> None:
    # Right for the block sizes the notebook names (4 and 8) only: the random third run catches it.
    def only_4_and_8(c: int, w: int, b: int) -> int:
        return max(c - w + 1, 0) // b if b in (4, 8) else 0

    assert_rejected(check_null_blocks(only_4_and_8), "your function says 0")



def test_null_blocks_catches_a_window_written_in() -> None:
    # Right for tiny-hybrid's window only: the KV cache manager's run with another window catches it.
    def only_32(c: int, w: int, b: int) -> int:
        return max(c - 32 + 1, 0) // b

    assert_rejected(check_null_blocks(only_32), "null block(s), your function says")


@pytest.mark.parametrize("block_size, prompt_len", [(4, 40), (5, 57)])
def test_manager_window_rows_replay_the_engines_rows(block_size: int, prompt_len: int) -> None:
    """The checker's model-free run (any window) gives the engine's rows for tiny-hybrid's window."""
    engine = sliding_window_rows(block_size, prompt_len)
    replay = manager_window_rows(32, block_size, prompt_len)
    assert [(s.step, s.context_len, s.null_blocks, len(s.row)) for s in replay] == \
        [(s.step, s.context_len, s.null_blocks, len(s.row)) for s in engine]
