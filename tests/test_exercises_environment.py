"""Checker of notebook 00 (environment): accepts a right answer written here, rejects wrong ones with a
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




def test_environment_report_and_workbook_map() -> None:
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["default device"] in ("cpu", "cuda")
    assert [nb.name[:2] for nb in list_notebooks()] == [f"{i:02d}" for i in range(13)]
    assert runs_here("cpu").startswith("yes")
    with pytest.raises(ValueError):
        runs_here("tpu")


def test_choose_backend(tiny: LLM) -> None:
    def right(priority: list[str], reasons: dict[str, list[str]]) -> str | None:
        for name in priority:
            if not reasons[name]:
                return name
        return None

    result = check_choose_backend(tiny, right)
    assert result, result.message
    assert "TORCH_REF serves 'model.layers.0.self_attn.attn'" in result.message
    # Right on this CPU (priority ['TORCH_REF']), wrong on the checker's own cases:
    for wrong, phrase in [
        (lambda p, r: p[0], "refuses the layer"),
        (lambda p, r: next((n for n in r if not r[n]), None), "expected"),
        (lambda p, r: "TORCH_REF", "expected"),
        # never None: the always-tried case where every backend refuses (random cases had it 8% of the time)
        (lambda p, r: next((n for n in p if not r[n]), p[0]), "expected None"),
    ]:
        assert_rejected(check_choose_backend(tiny, wrong), "For priority", phrase)
    assert_rejected(check_choose_backend(tiny, get_attn_backend), "pagedkv's own get_attn_backend")
    assert_rejected(check_choose_backend(tiny, lambda p, r: get_attn_backend(head_size=16, dtype=None,
                                                                        kv_cache_dtype=None, block_size=16)),
                    "calls pagedkv's own get_attn_backend")
    assert_rejected(check_choose_backend(tiny, "TORCH_REF"), "function itself")


def test_choose_backend_explains_each_kind_of_mistake() -> None:
    from pagedkv.exercises.environment import _explain_choice

    reasons = {"A": ["no"], "B": [], "C": [], "D": []}
    assert "A refuses the layer (no)" in _explain_choice("A", "B", ["A", "B", "C"], reasons)
    assert "B comes earlier" in _explain_choice("C", "B", ["A", "B", "C"], reasons)
    assert "only backends in the priority list" in _explain_choice("D", "B", ["A", "B", "C"], reasons)
    assert "return None" in _explain_choice("A", None, ["A"], reasons)
