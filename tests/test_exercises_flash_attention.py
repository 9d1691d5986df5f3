"""Checker of notebook 07 (flash attention): accepts a right answer written here, rejects wrong ones with a
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




def test_kernel_block_rows() -> None:
    def right(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
        k = block_size // kernel_block_size
        return [b * k + i for b in row for i in range(k)]

    result = check_kernel_block_rows(right)
    assert result, result.message
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: [x + i for x in row for i in range(b // kb)]),
                    "returned [5, 6, 7, 1, 2, 3, 12, 13, 14], expected [15, 16, 17, 3, 4, 5, 36, 37, 38]")
    # The notebook's answer typed in as a constant passes only the notebook's case.
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: [15, 16, 17, 3, 4, 5, 36, 37, 38]), "expected")
    assert_rejected(check_kernel_block_rows(to_kernel_block_table), "pagedkv's own to_kernel_block_table")
    assert_rejected(
        check_kernel_block_rows(lambda row, b, kb: to_kernel_block_table(torch.tensor([row]), b // kb)[0].tolist()),
        "calls pagedkv's own to_kernel_block_table",
    )
    assert_rejected(check_kernel_block_rows([15, 16, 17]), "function itself")
