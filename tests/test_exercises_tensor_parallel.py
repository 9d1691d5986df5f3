"""Notebook 10's checkers (right, wrong and package answers) and its layout view, against hand-worked values."""

from __future__ import annotations

import re

import pytest

from pagedkv.exercises.tensor_parallel import check_kv_cache_bytes, check_rank_heads
from pagedkv.models.layers import head_layout, rank_heads
from pagedkv.widgets.tensor_parallel import SHAPES, TensorParallelLayoutView, layout_table


def heads_by_hand(hq: int, hkv: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    per_rank = hq // tp
    q = list(range(rank * per_rank, (rank + 1) * per_rank))
    if hkv >= tp:
        return q, list(range(rank * (hkv // tp), (rank + 1) * (hkv // tp)))
    return q, [rank // (tp // hkv)]


def test_rank_heads_checker() -> None:
    assert check_rank_heads(heads_by_hand)
    def wrong(hq: int, hkv: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
        q, kv = heads_by_hand(hq, hkv, tp, rank)
        return q, kv if hkv >= tp else [rank % hkv]  # replicas taken round-robin: the wrong KV head

    verdict = check_rank_heads(wrong)
    assert not verdict and "replicated" in verdict.message
    assert not check_rank_heads(rank_heads)
    cheat = lambda hq, hkv, tp, rank: [list(r) for r in rank_heads(head_layout(hq, hkv, tp), rank)]  # noqa: E731
    assert "pagedkv's own" in check_rank_heads(cheat).message
    assert not check_rank_heads(lambda *a: None)


def test_kv_cache_bytes_checker() -> None:
    # K and V, 16 tokens, this rank's KV heads (at least one), head_dim values of 2 bytes, per layer and block.
    right = lambda layers, hq, hkv, d, tp, blocks: 2 * 16 * max(hkv // tp, 1) * d * 2 * layers * blocks  # noqa: E731
    assert check_kv_cache_bytes(right)
    whole = lambda layers, hq, hkv, d, tp, blocks: 2 * 16 * hkv * d * 2 * layers * blocks  # noqa: E731
    assert "whole model" in check_kv_cache_bytes(whole).message
    assert not check_kv_cache_bytes(lambda *a: 0)


def _cells(html: str, rank: int) -> list[str]:
    row = re.findall(r"<tr>(.*?)</tr>", html)[rank + 1]
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_layout_table_llama3_8b_tp2_by_hand() -> None:
    html = layout_table(SHAPES["Llama-3-8B (32 q / 8 kv heads)"], 2)
    # Rank 1: query heads 16-31, KV heads 4-7; q 16 x 128 rows, k and v 4 x 128 each; the MLP's second
    # half (14336 / 2 = 7168); vocabulary 128256 / 2 = 64128 rows; KV per token: 2 x 4 x 128 x 2 B x 32 layers.
    assert _cells(html, 1) == ["1", "16-31", "4-7", "2048 + 512 + 512", "2048-4095", "7168-14335 of each",
                               "7168-14335", "64128-128255", "65,536 B"]


def test_layout_table_mqa_tp4_replicates_the_kv_head() -> None:
    html = layout_table(SHAPES["an MQA model (32 q / 1 kv head)"], 4)
    for rank in range(4):
        assert _cells(html, rank)[2] == "0 (on 4 ranks)"
    assert _cells(html, 3)[1] == "24-31"


def test_view_refuses_a_choice_its_menus_lack() -> None:
    with pytest.raises(ValueError, match=r"tp_size 3 is not one of the choices \[1, 2, 4, 8, 16\]"):
        TensorParallelLayoutView(tp_size=3)
    with pytest.raises(ValueError, match="shape 'Llama-3-8B' is not one of the choices"):
        TensorParallelLayoutView("Llama-3-8B")


def test_view_explains_an_impossible_split() -> None:
    view = TensorParallelLayoutView("Qwen2-7B (28 q / 4 kv heads)", tp_size=8)
    assert "Cannot split" in view.html.value and "28" in view.html.value
    view.tp.value = 4
    assert 'data-tp="4"' in view.html.value


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_table_kv_bytes_match_the_real_layer(tp: int) -> None:
    from pagedkv.exercises.model_file import build_attention

    shape = SHAPES["Llama-3-8B (32 q / 8 kv heads)"]
    spec = build_attention(32, 8, tp).attn.get_kv_cache_spec()
    per_token = spec.page_size_bytes // spec.block_size * shape.num_hidden_layers
    assert _cells(layout_table(shape, tp), 0)[-1] == f"{per_token:,} B"
