"""Checker of notebook 03 (the forward context): accepts a right answer written here, rejects wrong ones with a
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




def test_attention_context(tiny: LLM) -> None:
    def right(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def whole_dict(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata, layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def other_layer(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers["model.layers.3.self_attn.attn"]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    assert check_attention_context(tiny, right)
    assert_rejected(check_attention_context(tiny, whole_dict), "whole attn_metadata dict")
    assert_rejected(check_attention_context(tiny, other_layer), "layer is wrong", "model.layers.3")

    def first_entries(name: str) -> tuple[Any, ...]:  # right on "tiny" (one group), not on "tiny-hybrid"
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return next(iter(ctx.attn_metadata.values())), layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    assert_rejected(check_attention_context(tiny, first_entries), "metadata of a layer in another group")

    def first_slots(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    assert_rejected(check_attention_context(tiny, first_slots), "slot mapping of a layer in another KV cache group")
    assert_rejected(check_attention_context(tiny, lambda name: name), "tuple of 4")
    assert_rejected(check_attention_context(tiny, lambda name: 1 / 0), "ZeroDivisionError")
    assert_rejected(check_attention_context(tiny, get_attention_context), "pagedkv's own get_attention_context")
    assert_rejected(check_attention_context(tiny, lambda name: get_attention_context(name)),
                    "calls pagedkv's own get_attention_context")
    assert not any(layer._forward_pre_hooks for layer in tiny.runner.attn_layers.values())  # hooks removed
