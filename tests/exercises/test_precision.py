"""Notebook 14's checkers: right answers written here from the rules (not from the package) pass; wrong ones (a split
count read off the batch, split-KV turned off, an invalid count, the block arithmetic's usual slips, the package's own
functions, a value that says it equals anything) fail with a message that holds no expected value."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from pagedkv.exercises import reveal
from pagedkv.exercises.precision import (
    SHOWN_BLOCK_CASES,
    block_case_config,
    check_num_blocks,
    check_num_splits,
    split_kv_attention,
)
from pagedkv.kernels.attention_config import split_count
from pagedkv.kv_cache.spec import get_kv_cache_config
from tests.exercises.checks import EqualToAnything, assert_rejected, assert_worked_solutions_pass

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1}
"""Bytes per cached value, by hand: e4m3 is one byte (pagedkv/kv_cache/fp8.py)."""


def right_splits(seq_len: int, batch_size: int, num_sms: int) -> int:
    return min(64, -(-seq_len // 256))  # a fixed split size of 256 keys: the request's length alone decides


def by_the_batch(seq_len: int, batch_size: int, num_sms: int) -> int:
    """Fill the GPU: the fewer the requests, the more splits (what choose_config does, simplified)."""
    return max(1, min(64, -(-seq_len // 16), 4 * num_sms // batch_size))


def right_blocks(memory: int, config: Any, block_size: int, kv_cache_dtype: str) -> int:
    per_block = config.num_hidden_layers * 2 * block_size * config.num_key_value_heads * config.head_dim
    return memory // (per_block * BYTES[kv_cache_dtype])


def test_split_kv_attention_is_attention_whatever_the_split_count_but_not_bit_for_bit() -> None:
    """The model of the kernel against float64 softmax attention; counts 1 and 4 differ only in the last bits."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 16, generator=g),
        torch.randn(200, 2, 16, generator=g),
        torch.randn(200, 2, 16, generator=g),
    )
    p = torch.softmax(torch.einsum("hd,khd->hk", q.double(), k.double()) / 4, -1)
    expected = torch.einsum("hk,khd->hd", p, v.double())
    rows = {s: split_kv_attention(q, k, v, s) for s in (1, 4, 13)}
    for row in rows.values():
        torch.testing.assert_close(row.double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(rows[1], rows[4]) and not torch.equal(rows[4], rows[13])
    assert torch.equal(split_kv_attention(q, k, v, 4), rows[4])  # the same count: the same bits


def test_num_splits_passes_a_rule_of_the_request_alone() -> None:
    result = check_num_splits(right_splits)
    assert result, result.message
    assert check_num_splits(lambda n, b, sms: min(64, -(-n // 16), max(1, sms // 4)) if n >= 64 else 1)


@pytest.mark.parametrize(
    ("wrong", "phrases"),
    [
        (by_the_batch, ["split(s) alone and", "in a batch of", "differs in", "a row's bits follow its split count"]),
        (lambda n, b, sms: right_splits(n, 1, sms) if b < 64 else 1, ["in a batch of 64"]),
        (lambda n, b, sms: 1, ["= 1: a lone request of", "Keep split-KV"]),
        (lambda n, b, sms: 4, ["is not a split count for 10 keys", "from 1 to 1"]),
        (lambda n, b, sms: min(128, -(-n // 16)), ["is not a split count", "the workspace holds 64"]),
        (lambda n, b, sms: n // 256, ["= 0 is not a split count"]),
        (lambda n, b, sms: 1.0, ["= 1.0 is not a split count"]),
        (lambda n, b, sms: EqualToAnything(1), ["= 1: a lone request of"]),  # graded as the 1 it holds
    ],
)
def test_num_splits_rejects_wrong_rules(wrong: Any, phrases: list[str]) -> None:
    assert_rejected(check_num_splits(wrong), *phrases)


def test_num_splits_rejects_the_package() -> None:
    engine_rule = lambda n, b, sms: split_count(b * 8, -(-n // 16), 4 * sms, 2)  # noqa: E731
    assert_rejected(check_num_splits(engine_rule), "calls split_count")
    on_a_thread = lambda n, b, sms: ThreadPoolExecutor(1).submit(engine_rule, n, b, sms).result()  # noqa: E731
    assert_rejected(check_num_splits(on_a_thread), "calls split_count")
    assert_rejected(check_num_splits(split_count), "pagedkv's own")
    assert not check_num_splits(4)


def test_num_blocks() -> None:
    result = check_num_blocks(right_blocks)
    assert result, result.message
    # llama3-8b, 40 GiB, blocks of 16: 2 MiB per block in bf16 (32 layers x 2 x 16 x 8 x 128 x 2 bytes), 1 in fp8.
    assert [right_blocks(m, block_case_config(c), bs, d) for c in SHOWN_BLOCK_CASES for m, _, bs, d in [c]][:2] == [
        20480,
        40960,
    ]


def _wrong_bytes(d: str) -> int:
    return 2 if d.startswith("fp8") else BYTES[d]


@pytest.mark.parametrize(
    ("wrong", "phrase"),
    [
        (lambda m, c, bs, d: 2 * right_blocks(m, c, bs, d), "a block holds K and V"),
        (lambda m, c, bs, d: right_blocks(m, c, bs, d) * c.num_hidden_layers, "allocated in every layer"),
        (
            lambda m, c, bs, d: m // (c.num_hidden_layers * 2 * bs * c.num_attention_heads * c.head_dim * BYTES[d]),
            "not the query heads",
        ),
        (
            lambda m, c, bs, d: (
                m // (c.num_hidden_layers * 2 * bs * c.num_key_value_heads * c.head_dim * _wrong_bytes(d))
            ),
            "an fp8 value takes one byte",
        ),
        (lambda m, c, bs, d: right_blocks(m, c, bs, d) + 1, "round down"),
        (lambda m, c, bs, d: right_blocks(m, c, bs, d) - 1, "the reserved null block"),
        (lambda m, c, bs, d: right_blocks(m, c, bs, d) * bs, "that is tokens"),
        (lambda m, c, bs, d: right_blocks(m, c, bs, d) // 3, "bytes per block = num_hidden_layers x 2"),
    ],
)
def test_num_blocks_rejects_wrong_answers(wrong: Any, phrase: str) -> None:
    result = check_num_blocks(wrong)
    assert_rejected(result, "is not the engine's block count", phrase)
    assert "20480" not in result.message.split("is not the engine's")[1]


def test_num_blocks_names_the_head_dim_slip() -> None:
    """qwen3-0.6b's head_dim (128) is not hidden_size / num_attention_heads (64): only that case catches the slip."""

    def from_hidden_size(m: int, c: Any, bs: int, d: str) -> int:
        head = c.hidden_size // c.num_attention_heads
        return m // (c.num_hidden_layers * 2 * bs * c.num_key_value_heads * head * BYTES[d])

    assert_rejected(check_num_blocks(from_hidden_size), "'fp8')", "need not be hidden_size // num_attention_heads")


def test_num_blocks_rejects_the_package_and_odd_answers() -> None:
    def by_the_engine(m: int, c: Any, bs: int, d: str) -> int:
        from pagedkv.exercises.precision import _engine_blocks

        return _engine_blocks(m, c, bs, d)

    assert_rejected(check_num_blocks(by_the_engine), "calls _engine_blocks")
    assert_rejected(check_num_blocks(get_kv_cache_config), "pagedkv's own get_kv_cache_config")
    assert_rejected(check_num_blocks(lambda *a: EqualToAnything(0)), "is not the engine")  # graded as the 0 it holds
    assert_rejected(check_num_blocks(lambda *a: float(right_blocks(*a))), "should be an int, not a float")

    def changes_the_preset(m: int, c: Any, bs: int, d: str) -> int:
        c.num_hidden_layers = 1  # a copy: the preset itself stays as it was
        return right_blocks(m, c, bs, d)

    assert not check_num_blocks(changes_the_preset)
    assert check_num_blocks(right_blocks)


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        result = check_num_blocks(lambda m, c, bs, d: right_blocks(m, c, bs, d) + 1)
    assert "Try 3" in result.message
    reveal()
    worked = capsys.readouterr().out
    assert "2 (K, V) x 16 tokens x 8 KV heads x 128 x 2 byte(s) (torch.bfloat16) = 65536 bytes" in worked
    assert worked.rstrip().endswith("42949672960 // 2097152 = 20480 blocks")
    for _ in range(3):
        check_num_splits(by_the_batch)
    reveal()
    worked = capsys.readouterr().out
    assert "your counts for 200 keys on 132 SMs: batch 1: 13" in worked and "batch 1024: 1" in worked
    assert "min(64, cdiv(200, 256)) = 1 in every batch" in worked


def test_the_notebooks_worked_solutions_pass_and_are_not_run() -> None:
    """Each worked solution sits in a collapsed markdown cell (Run All does not execute it) and passes its checker;
    no saved output of the notebook shows a pass mark, so a pass on screen is the student's own."""
    checkers = {"check_num_splits": check_num_splits, "check_num_blocks": check_num_blocks}
    assert_worked_solutions_pass("14_precision_and_determinism.ipynb", 2, checkers)
