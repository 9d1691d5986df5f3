"""Notebook 11's checkers: right answers written here pass; the answers that fooled the second edition (the
package's spec, split or absorption called directly or on a thread, the checker's frame read, the notebook's
answers copied as constants) fail with a message that holds no expected value."""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from pagedkv.attention.mla.common import split_decodes_and_prefills
from pagedkv.exercises import mla, reveal
from pagedkv.kv_cache.spec import MLAAttentionSpec
from tests.exercises.checks import EqualToAnything, assert_rejected, assert_worked_solutions_pass


def right_bytes(layers: int, rank: int, rope: int, tokens: int) -> int:
    return layers * tokens * (rank + rope) * 2


def right_split(query_lens: list[int]) -> tuple[int, int, int, int]:
    d = 0
    while d < len(query_lens) and query_lens[d] == 1:
        d += 1
    return d, len(query_lens) - d, d, sum(query_lens[d:])


def right_query(q: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> torch.Tensor:
    heads, rank = q.shape[1], kv_b_weight.shape[1]
    w_uk = kv_b_weight.view(heads, -1, rank)[:, :nope]  # each head's rows: [W_UK (nope); W_UV (v)]
    return torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope], w_uk), q[..., nope:]], dim=-1)


def count_the_ones(query_lens: list[int]) -> tuple[int, int, int, int]:
    """The notebook's first try: every one-token request is a decode."""
    ones = [n for n in query_lens if n == 1]
    longer = [n for n in query_lens if n != 1]
    return len(ones), len(longer), len(ones), sum(longer)


def test_right_answers_pass() -> None:
    assert mla.check_mla_cache_bytes(right_bytes)
    assert mla.check_decode_split(right_split)
    assert mla.check_absorbed_query(right_query)


def test_wrong_sizes_name_the_rule_not_the_size() -> None:
    doubled = mla.check_mla_cache_bytes(lambda *a: 2 * right_bytes(*a))
    assert_rejected(doubled, "fn(27, 512, 64, ", "ONE latent row per token")
    case = [int(n) for n in re.findall(r"\d+", doubled.message.split(" = ")[0])]
    assert str(right_bytes(*case)) not in doubled.message and f"{right_bytes(*case):,}" not in doubled.message
    assert_rejected(
        mla.check_mla_cache_bytes(lambda layers, rank, rope, tokens: layers * tokens * rank * 2), "also holds k_pe"
    )
    assert_rejected(mla.check_mla_cache_bytes(lambda *a: 0), "one row of kv_lora_rank + qk_rope_head_dim")


def test_wrong_splits_name_the_rule_not_the_split() -> None:
    every_one_token = mla.check_decode_split(count_the_ones)
    assert_rejected(every_one_token, "fn([5, 1, 1])", "LEADING")
    assert "(0, 3, 0, 7)" not in every_one_token.message

    def two_is_a_decode(lens: list[int]) -> tuple[int, int, int, int]:
        k = next((i for i, n in enumerate(lens) if n > 2), len(lens))
        return k, len(lens) - k, sum(lens[:k]), sum(lens[k:])

    # [1, 2, 1] is tried on every call: 2s are rare among the random batches.
    assert_rejected(mla.check_decode_split(two_is_a_decode, num_hidden=0), "fn([1, 2, 1])", "ONE query token")
    requests_as_tokens = mla.check_decode_split(lambda lens: (*right_split(lens)[:2], *right_split(lens)[:2]))
    assert_rejected(requests_as_tokens, "fn([1, 1, 1, 7])", "count the query tokens")
    assert_rejected(mla.check_decode_split(lambda lens: (0, 0, 0, 0)), "the first two numbers add up")


def test_wrong_queries_name_the_rule() -> None:
    def all_uk_first(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:  # [W_UK of all heads; W_UV ...]
        heads, rank = q.shape[1], w.shape[1]
        w_uk = w[: heads * nope].view(heads, nope, rank)
        return torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope], w_uk), q[..., nope:]], dim=-1)

    assert_rejected(mla.check_absorbed_query(all_uk_first), "head after head, W_UK[h]")

    def pe_first(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:  # [q_pe | ql_nope]
        right = right_query(q, w, nope)
        return torch.cat([right[..., w.shape[1] :], right[..., : w.shape[1]]], dim=-1)

    assert not mla.check_absorbed_query(pe_first)

    def rope_dropped_to_zero(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:
        right = right_query(q, w, nope)
        right[..., w.shape[1] :] = 0
        return right

    assert_rejected(mla.check_absorbed_query(rope_dropped_to_zero), "stays q_pe")
    assert_rejected(
        mla.check_absorbed_query(lambda q, w, nope: right_query(q, w, nope)[..., : w.shape[1]]),
        "kv_lora_rank + qk_rope_head_dim",
    )
    rounded = mla.check_absorbed_query(lambda q, w, nope: right_query(q, w, nope).float())
    assert_rejected(rounded, "returned torch.float32", "dtype=q.dtype")


def test_answers_copied_for_the_shown_cases_fail() -> None:
    lite = right_bytes(27, 512, 64, 1)  # DeepSeek-V2-Lite, per token: the notebook's table shows it
    assert not mla.check_mla_cache_bytes(lambda layers, rank, rope, tokens: lite // 27 * layers * tokens)
    table = {tuple(lens): right_split(lens) for lens in mla.SHOWN_SPLITS + [[1, 2, 1]]}
    assert_rejected(mla.check_decode_split(lambda lens: table.get(tuple(lens), (0, 0, 0, 0))), "fn(")


def test_the_package_fails_however_it_is_called() -> None:
    def by_spec(layers: int, rank: int, rope: int, tokens: int) -> int:
        return MLAAttentionSpec(1, 1, rank + rope, torch.bfloat16).page_size_bytes * tokens * layers

    assert_rejected(mla.check_mla_cache_bytes(by_spec), "calls MLAAttentionSpec.page_size_bytes")
    assert_rejected(
        mla.check_mla_cache_bytes(lambda *a: ThreadPoolExecutor().submit(by_spec, *a).result()),
        "calls MLAAttentionSpec.page_size_bytes",
    )

    assert_rejected(mla.check_decode_split(split_decodes_and_prefills), "pagedkv's own split_decodes_and_prefills")

    def split_on_a_thread(lens: list[int]) -> tuple[int, int, int, int]:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(split_decodes_and_prefills, mla._common(lens)).result()

    assert_rejected(mla.check_decode_split(split_on_a_thread), "calls split_decodes_and_prefills")

    def by_impl(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:
        from pagedkv.attention.mla.common import MLACommonImpl

        dims = SimpleNamespace(
            qk_nope_head_dim=nope, v_head_dim=w.shape[0] // q.shape[1] - nope, kv_lora_rank=w.shape[1]
        )
        impl = SimpleNamespace(mla_dims=dims, num_heads=q.shape[1])
        MLACommonImpl.process_weights_after_loading(impl, w)  # type: ignore[arg-type]
        return torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope], impl.W_UK), q[..., nope:]], dim=-1)

    assert_rejected(mla.check_absorbed_query(by_impl), "calls MLACommonImpl.process_weights_after_loading")
    assert_rejected(
        mla.check_absorbed_query(lambda *a: ThreadPoolExecutor().submit(by_impl, *a).result()),
        "calls MLACommonImpl.process_weights_after_loading",
    )


def test_reading_the_checkers_frames_fails() -> None:
    def peek(lens: list[int]) -> object:
        return sys._getframe(1).f_locals.get("expected", right_split(lens))

    assert_rejected(mla.check_decode_split(peek), "reading the checker's frames")
    assert_rejected(
        mla.check_mla_cache_bytes(lambda *a: sys._getframe(1).f_locals.get("expected", 0)),
        "reading the checker's frames",
    )
    assert_rejected(
        mla.check_absorbed_query(lambda q, w, n: sys._getframe(1).f_locals.get("want", q)),
        "reading the checker's frames",
    )


def test_form_of_the_answer() -> None:
    assert_rejected(mla.check_mla_cache_bytes(1152), "function itself")
    assert_rejected(mla.check_mla_cache_bytes(lambda *a: 1152.0), "should be an int, not a float")
    assert_rejected(mla.check_decode_split(lambda lens: "0, 3"), "four ints")
    assert_rejected(mla.check_absorbed_query(lambda q, w, n: None), "return a tensor")
    assert_rejected(mla.check_absorbed_query(lambda q, w, n: 1 / 0), "raised ZeroDivisionError")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    first = mla.check_decode_split(count_the_ones)
    assert "reveal()" not in first.message
    reveal()
    assert "1 wrong try so far" in capsys.readouterr().out
    mla.check_decode_split(count_the_ones)
    third = mla.check_decode_split(count_the_ones)
    assert "Try 3" in third.message and "(0, 3, 0, 7)" not in third.message
    reveal()
    worked = capsys.readouterr().out
    assert "request 0 is the first with more than one query token (5)" in worked
    assert "fn([5, 1, 1]) = (0, 3, 0, 7)" in worked
    assert mla.check_decode_split(right_split)  # a pass resets the count
    reveal()
    assert "0 wrong tries so far" in capsys.readouterr().out


def test_reveal_works_out_the_size_and_the_query(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        result = mla.check_mla_cache_bytes(lambda *a: 2 * right_bytes(*a))
    case = [int(n) for n in re.findall(r"\d+", result.message.split(" = ")[0])]
    reveal()
    worked = capsys.readouterr().out
    assert "512 + 64 = 576 values x 2 bytes (bfloat16) = 1,152 bytes" in worked
    assert f"= {right_bytes(*case):,}" in worked
    for _ in range(3):
        mla.check_absorbed_query(lambda q, w, nope: right_query(q, w, nope).flip(1))
    reveal()
    worked = capsys.readouterr().out
    assert "W_UK = kv_b_weight.view(16, 128 + 128, 512)[:, :128]" in worked and "torch.cat([ql_nope, q_pe]" in worked


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its
    checker; no saved output of the notebook shows a pass mark, so a pass on screen is the student's own."""
    checkers = {
        name: getattr(mla, name) for name in ("check_absorbed_query", "check_mla_cache_bytes", "check_decode_split")
    }
    assert_worked_solutions_pass("11_mla.ipynb", 3, {"torch": torch, **checkers})


def test_values_that_equal_anything_fail() -> None:
    lie = EqualToAnything(0)
    assert_rejected(mla.check_mla_cache_bytes(lambda *a: lie), "is not the size")  # graded as the 0 it holds
    assert_rejected(mla.check_decode_split(lambda lens: (lie, lie, lie, lie)), "is not the builder's split")

    class AlwaysClose(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if func is torch.allclose:
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    def any_tensor(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:
        return torch.zeros(q.shape[0], q.shape[1], w.shape[1] + q.shape[2] - nope, dtype=q.dtype).as_subclass(
            AlwaysClose
        )

    assert_rejected(mla.check_absorbed_query(any_tensor), "return a tensor")
