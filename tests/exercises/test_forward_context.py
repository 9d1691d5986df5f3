"""Checker of notebook 03 (the forward context): accepts a right answer written here, rejects wrong ones with a
message that says what is wrong (never the right objects), and rejects the package's own lookup however it is
reached (handed back, called, called on a thread, or its answer read from the checker's frames)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pagedkv import LLM
from pagedkv.attention.ops import get_attention_context
from pagedkv.exercises import reveal
from pagedkv.exercises.forward_context import check_attention_context
from pagedkv.forward_context import get_forward_context
from tests.exercises.checks import (
    assert_rejected,
    notebook_cells,
    run_solution,
    saved_outputs_show_no_pass,
    worked_solutions,
)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", num_kv_blocks=32, enable_prefix_caching=False)


def right(name: str) -> tuple[Any, ...]:
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[name]
    metadata = None if ctx.attn_metadata is None else ctx.attn_metadata[name]
    return metadata, layer, layer.kv_cache, ctx.slot_mapping.get(name)


def test_right_answer_passes(tiny: LLM) -> None:
    result = check_attention_context(tiny, right)
    assert result, result.message
    assert "made-up step" in result.message and "'tiny-hybrid'" in result.message
    assert not any(layer._forward_pre_hooks for layer in tiny.runner.attn_layers.values())  # hooks removed


def test_wrong_lookups_are_told_the_rule(tiny: LLM) -> None:
    def whole_dict(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata, layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def other_layer(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers["model.layers.3.self_attn.attn"]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def first_entries(name: str) -> tuple[Any, ...]:  # right on "tiny" (one group), not on "tiny-hybrid"
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return next(iter(ctx.attn_metadata.values())), layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    def first_slots(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    def slots_must_exist(name: str) -> tuple[Any, ...]:  # right in every engine step, wrong where a slot is missing
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        metadata = None if ctx.attn_metadata is None else ctx.attn_metadata[name]
        return metadata, layer, layer.kv_cache, ctx.slot_mapping[name]

    def no_profile_run(name: str) -> tuple[Any, ...]:  # an engine step always has metadata; a profile run has none
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    assert_rejected(check_attention_context(tiny, whole_dict), "whole attn_metadata dict")
    assert_rejected(check_attention_context(tiny, other_layer), "layer is wrong", "model.layers.3")
    assert_rejected(check_attention_context(tiny, first_entries), "another attention group")
    assert_rejected(check_attention_context(tiny, first_slots), "slot mapping of a layer in another KV cache group")
    assert_rejected(check_attention_context(tiny, slots_must_exist), "raised KeyError")
    assert_rejected(check_attention_context(tiny, no_profile_run), "made-up profile run", "raised TypeError")
    assert_rejected(check_attention_context(tiny, lambda name: name), "tuple of 4")
    assert_rejected(check_attention_context(tiny, lambda name: 1 / 0), "ZeroDivisionError")


def test_a_wrong_cache_is_not_shown_the_right_one(tiny: LLM) -> None:
    def copied_cache(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache.clone(), ctx.slot_mapping.get(name)

    result = check_attention_context(tiny, copied_cache)
    assert_rejected(result, "kv_cache is wrong", "bound the cache to the layer object")
    assert "[2, 32, 16, 2, 16]" not in result.message and "(2, 32, 16, 2, 16)" not in result.message


def test_the_package_lookup_is_turned_away_however_it_is_reached(tiny: LLM) -> None:
    def on_a_thread(name: str) -> Any:  # the answer: the package's lookup on another thread
        return ThreadPoolExecutor(max_workers=1).submit(get_attention_context, name).result()

    def reads_the_checker(name: str) -> Any:  # the answer: the checker's own expected value
        return sys._getframe(1).f_locals["expected"]

    def wrapped(name: str) -> Any:
        lookup = get_attention_context
        return lookup(name)

    assert_rejected(check_attention_context(tiny, get_attention_context), "pagedkv's own get_attention_context")
    assert_rejected(check_attention_context(tiny, wrapped), "Your answer calls get_attention_context")
    assert_rejected(check_attention_context(tiny, on_a_thread), "Your answer calls get_attention_context")
    assert_rejected(check_attention_context(tiny, reads_the_checker), "reading the checker's frames")


def test_three_wrong_tries_offer_reveal_with_the_worked_lookup(tiny: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    def whole_dict(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata, layer, layer.kv_cache, ctx.slot_mapping.get(name)

    messages = [check_attention_context(tiny, whole_dict).message for _ in range(3)]
    assert "reveal()" not in messages[1] and "reveal()" in messages[2]
    reveal()
    worked = capsys.readouterr().out
    assert "ctx = get_forward_context()" in worked
    assert "ctx.attn_metadata[layer_name]" in worked and "layer.kv_cache" in worked
    assert "slot_mapping.get(layer_name)" in worked and "shape [2, 32, 16, 2, 16]" in worked
    assert check_attention_context(tiny, right)  # a pass resets the count
    reveal()
    assert "0 wrong tries so far" in capsys.readouterr().out


def test_the_notebooks_worked_solution_passes_and_is_not_run(tiny: LLM) -> None:
    """The worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes the
    checker; no saved output shows a pass mark, so a pass on screen is the student's own."""
    (code,) = worked_solutions("03_the_forward_context.ipynb")
    namespace = {
        "check_attention_context": check_attention_context,
        "get_forward_context": get_forward_context,
        "llm": tiny,
    }
    assert run_solution(code, namespace)
    assert saved_outputs_show_no_pass("03_the_forward_context.ipynb")
    cells = notebook_cells("03_the_forward_context.ipynb")
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "getsource(get_attention_context)" not in source  # the lookup's code is the exercise
    assert all("enable_prefix_caching=False" in line for line in source.splitlines() if "LLM(" in line)
