"""Checker of notebook 01 (the model file): accepts a right answer written here, rejects wrong ones with a
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



def test_qkv_width() -> None:
    def right(hidden_size: int, hq: int, hkv: int, head_dim: int, tp: int) -> int:
        return (hq // tp + 2 * max(hkv // tp, 1)) * head_dim

    result = check_qkv_width(right)
    assert result, result.message
    assert "(7 + 2 x 1) heads x 128" in result.message  # Qwen2-7B at tp_size 4, worked by hand: 1152
    qwen = "fn(3584, 28, 4, 128, 4)"
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d), qwen, "whole model")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: 3 * (hq // tp) * d), qwen, "own K and V")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq // tp) * d), qwen, "only the query part")
    # Right for Qwen2-7B (4 KV heads over 4 ranks), wrong once KV heads are replicated: 40 random cases hold one.
    floor_split = check_qkv_width(lambda h, hq, hkv, d, tp: (hq // tp + 2 * (hkv // tp)) * d, num_hidden=0)
    assert_rejected(floor_split, "fn(4096, 64, 8, 128, 16)", "replicated")  # a fixed case, not left to chance
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d // tp, num_hidden=0),
                    "fn(4096, 64, 8, 128, 16)")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: "1152"), qwen, "an int")
    # The notebook's number typed in passes its case only; the module built by the package does not count.
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: 1152), "is not it")
    assert_rejected(check_qkv_width(build_attention), "pagedkv's own build_attention")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: build_attention(hq, hkv, tp, d, h).qkv_proj.out_features),
                    "calls pagedkv's own build_attention")
    assert_rejected(check_qkv_width(1152), "function itself")


def test_head_layout() -> None:
    def right(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        return hq // tp, max(hkv // tp, 1), max(tp // hkv, 1)

    assert check_head_layout(right)
    assert_rejected(check_head_layout(lambda hq, hkv, tp: (hq // tp, hkv // tp, 1)),
                    "KV heads per rank 0 (expected 1)", "copied")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: (hq // tp, max(hkv // tp, 1), 1)),
                    "replicas of each KV head 1 (expected 2)")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: None), "tuple of three ints")
    assert_rejected(check_head_layout(42), "function itself")
    assert_rejected(check_head_layout(head_layout), "pagedkv's own head_layout")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: head_layout(hq, hkv, tp)),
                    "calls pagedkv's own head_layout")


def test_head_layout_has_cases_the_notebook_never_printed() -> None:
    # A table of every fixed case (the notebook prints most of them) fails on the random ones.
    printed = {}
    for hq, hkv in MODEL_HEADS:
        for tp in TP_SIZES:
            try:
                printed[(hq, hkv, tp)] = head_layout(hq, hkv, tp)
            except ValueError:
                continue

    def copied(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        layout = printed.get((hq, hkv, tp))
        return (layout.num_heads, layout.num_kv_heads, layout.kv_head_replicas) if layout else (0, 0, 0)

    assert_rejected(check_head_layout(copied), "expected")
