"""Notebook 10's checkers and its layout view, against hand-worked values. A right answer written here passes;
the answers that fooled the second edition (the package's layout called directly, on a thread, the checker's
frame read, the notebook's answers copied as constants) fail with a message that holds no expected value."""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedkv.exercises import reveal
from pagedkv.exercises.model_file import build_attention
from pagedkv.exercises.tensor_parallel import SHOWN_CASES, check_kv_cache_bytes, check_rank_heads
from pagedkv.models.layers import head_layout, rank_heads
from pagedkv.widgets.tensor_parallel import SHAPES, TensorParallelLayoutView, layout_table
from tests.exercises.checks import EqualToAnything, assert_rejected, assert_worked_solutions_pass


def heads_by_hand(hq: int, hkv: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    per_rank = hq // tp
    q = list(range(rank * per_rank, (rank + 1) * per_rank))
    if hkv >= tp:
        return q, list(range(rank * (hkv // tp), (rank + 1) * (hkv // tp)))
    return q, [rank // (tp // hkv)]


def split_everything(hq: int, hkv: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """The notebook's first try: KV heads split like query heads, even when there are fewer than ranks."""
    q, kv = hq // tp, max(hkv // tp, 1)
    return list(range(rank * q, (rank + 1) * q)), list(range(rank * kv, (rank + 1) * kv))


def bytes_by_hand(layers: int, hq: int, hkv: int, d: int, tp: int, blocks: int) -> int:
    # K and V, 16 tokens, this rank's KV heads (at least one), head_dim values of 2 bytes, per layer and block.
    return 2 * 16 * max(hkv // tp, 1) * d * 2 * layers * blocks


def test_right_answers_pass() -> None:
    assert check_rank_heads(heads_by_hand)
    assert check_kv_cache_bytes(bytes_by_hand)
    # The hand-worked rule is the real layer's, on the shown shapes too.
    for hq, hkv, tp in SHOWN_CASES:
        for rank in range(tp):
            real = rank_heads(head_layout(hq, hkv, tp), rank)
            assert heads_by_hand(hq, hkv, tp, rank) == tuple(list(r) for r in real)


def test_wrong_heads_name_the_rule_not_the_heads() -> None:
    # Llama-3-70B over 16 ranks, rank 1: its KV head is 0 (worked by hand: query heads 4-7, group of 8).
    result = check_rank_heads(split_everything)
    assert_rejected(result, "fn(64, 8, 16, 1)", "replicated on 2 ranks", "the KV heads [1] are not rank 1's")
    assert "[0]" not in result.message and "[4, 5, 6, 7]" not in result.message
    local = check_rank_heads(lambda hq, hkv, tp, rank: (list(range(hq // tp)), heads_by_hand(hq, hkv, tp, rank)[1]))
    assert_rejected(local, "fn(32, 8, 2, 1)", "global indices")
    round_robin = check_rank_heads(
        lambda hq, hkv, tp, rank: (
            heads_by_hand(hq, hkv, tp, rank)[0],
            heads_by_hand(hq, hkv, tp, rank)[1] if hkv >= tp else [rank % hkv],
        )
    )
    assert_rejected(round_robin, "the one its query heads attend to")


def test_wrong_sizes_name_the_rule_not_the_size() -> None:
    whole = check_kv_cache_bytes(lambda layers, hq, hkv, d, tp, blocks: 2 * 16 * hkv * d * 2 * layers * blocks)
    assert_rejected(whole, "whole model's")
    expected = bytes_by_hand(*[int(n) for n in re.findall(r"-?\d+", whole.message.split("=")[0])])
    assert str(expected) not in whole.message and f"{expected:,}" not in whole.message
    assert_rejected(check_kv_cache_bytes(lambda *a: bytes_by_hand(*a) // 2), "a K and a V")
    assert_rejected(check_kv_cache_bytes(lambda *a: bytes_by_hand(*a) * 2), "2 bytes")
    assert_rejected(check_kv_cache_bytes(lambda *a: 0), "is not what one rank allocates")
    assert_rejected(check_kv_cache_bytes(lambda *a: 1.5), "should be an int, not a float")


def test_answers_copied_for_the_shown_shapes_fail() -> None:
    """Right on the notebook's shapes (copied from a message or the layout view), wrong elsewhere."""
    table = {(hq, hkv, tp, rank): heads_by_hand(hq, hkv, tp, rank) for hq, hkv, tp in SHOWN_CASES for rank in range(tp)}
    result = check_rank_heads(lambda *case: table.get(case, ([], [])))
    assert_rejected(result, "fn(")
    assert not check_kv_cache_bytes(lambda layers, hq, hkv, d, tp, blocks: 2 * 16 * 4 * 128 * 2 * layers * blocks)


def test_the_package_fails_however_it_is_called() -> None:
    def by_layout(hq: int, hkv: int, tp: int, rank: int) -> list[list[int]]:
        return [list(r) for r in rank_heads(head_layout(hq, hkv, tp), rank)]

    def on_a_thread(hq: int, hkv: int, tp: int, rank: int) -> list[list[int]]:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(by_layout, hq, hkv, tp, rank).result()

    assert_rejected(check_rank_heads(rank_heads), "pagedkv's own rank_heads")
    assert_rejected(check_rank_heads(by_layout), "calls head_layout")
    assert_rejected(check_rank_heads(on_a_thread), "calls head_layout")

    def by_spec(layers: int, hq: int, hkv: int, d: int, tp: int, blocks: int) -> int:
        return build_attention(hq, hkv, tp, d).attn.get_kv_cache_spec().page_size_bytes * layers * blocks

    def spec_on_a_thread(*args: int) -> int:
        return ThreadPoolExecutor().submit(by_spec, *args).result()

    assert_rejected(check_kv_cache_bytes(by_spec), "calls build_attention")
    assert_rejected(check_kv_cache_bytes(spec_on_a_thread), "calls build_attention")

    def heads_by_hand_sized_by_spec(layers: int, hq: int, hkv: int, d: int, tp: int, blocks: int) -> int:
        import torch

        from pagedkv.kv_cache.spec import FullAttentionSpec

        spec = FullAttentionSpec(16, max(hkv // tp, 1), d, torch.bfloat16)
        return spec.page_size_bytes * layers * blocks

    assert_rejected(check_kv_cache_bytes(heads_by_hand_sized_by_spec), "page_size_bytes")


def test_reading_the_checkers_frames_fails() -> None:
    def peek(*args: int) -> object:
        return sys._getframe(1).f_locals.get("expected", heads_by_hand(*args))

    assert_rejected(check_rank_heads(peek), "reading the checker's frames")
    assert_rejected(
        check_kv_cache_bytes(lambda *a: sys._getframe(2).f_locals.get("expected", 0)), "reading the checker's frames"
    )


def test_form_of_the_answer() -> None:
    assert_rejected(check_rank_heads([0, 1]), "function itself")
    assert_rejected(check_rank_heads(lambda *a: None), "must return (query heads, KV heads)")
    assert_rejected(check_rank_heads(lambda *a: (["0"], [0])), "two lists of head indices")
    assert_rejected(check_rank_heads(lambda *a: 1 / 0), "raised ZeroDivisionError")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    first = check_rank_heads(split_everything)
    assert "reveal()" not in first.message
    check_rank_heads(split_everything)
    third = check_rank_heads(split_everything)
    assert "Try 3" in third.message and "reveal()" in third.message
    reveal()
    worked = capsys.readouterr().out
    assert "replicated on 16 / 8 = 2 ranks" in worked and "fn(64, 8, 16, 1) = ([4, 5, 6, 7], [0])" in worked
    assert check_rank_heads(heads_by_hand)  # a pass resets the count
    reveal()
    assert "0 wrong tries so far" in capsys.readouterr().out


def test_reveal_works_out_the_size(capsys: pytest.CaptureFixture[str]) -> None:
    def whole(layers: int, hq: int, hkv: int, d: int, tp: int, blocks: int) -> int:
        return 2 * 16 * hkv * d * 2 * layers * blocks

    for _ in range(3):
        result = check_kv_cache_bytes(whole)
    assert "Try 3" in result.message
    call = result.message.split(" = ")[0]
    expected = bytes_by_hand(*[int(n) for n in re.findall(r"\d+", call)])
    reveal()
    worked = capsys.readouterr().out
    assert "2 (K and V) x 16 tokens" in worked and f"{call} = " in worked and f"{expected:,}" in worked


def _cells(html: str, rank: int) -> list[str]:
    row = re.findall(r"<tr>(.*?)</tr>", html)[rank + 1]
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_layout_table_llama3_8b_tp2_by_hand() -> None:
    html = layout_table(SHAPES["Llama-3-8B (32 q / 8 kv heads)"], 2)
    # Rank 1: query heads 16-31, KV heads 4-7; q 16 x 128 rows, k and v 4 x 128 each; the MLP's second
    # half (14336 / 2 = 7168); vocabulary 128256 / 2 = 64128 rows; KV per token: 2 x 4 x 128 x 2 B x 32 layers.
    assert _cells(html, 1) == [
        "1",
        "16-31",
        "4-7",
        "2048 + 512 + 512",
        "2048-4095",
        "7168-14335 of each",
        "7168-14335",
        "64128-128255",
        "65,536 B",
    ]


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


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its
    checker; no saved output of the notebook shows a pass mark, so a pass on screen is the student's own."""
    checkers = {"check_rank_heads": check_rank_heads, "check_kv_cache_bytes": check_kv_cache_bytes}
    assert_worked_solutions_pass("10_tensor_parallelism.ipynb", 2, checkers)


def test_an_int_that_equals_anything_fails() -> None:
    lie = EqualToAnything(0)
    assert_rejected(check_rank_heads(lambda *a: ([lie], [lie])), "are not rank 0")  # graded as the [0] it holds
    assert_rejected(check_kv_cache_bytes(lambda *a: lie))
