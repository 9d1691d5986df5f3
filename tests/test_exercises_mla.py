"""Notebook 11's checkers accept right answers and reject wrong ones and the package's own code."""

from __future__ import annotations

import torch

from pagedkv.attention.mla.common import split_decodes_and_prefills
from pagedkv.exercises import mla
from pagedkv.kv_cache.spec import MLAAttentionSpec


def right_bytes(layers: int, rank: int, rope: int, tokens: int) -> int:
    return layers * tokens * (rank + rope) * 2


def right_split(query_lens: list[int]) -> tuple[int, int, int, int]:
    d = 0
    while d < len(query_lens) and query_lens[d] == 1:
        d += 1
    return d, len(query_lens) - d, d, sum(query_lens[d:])


def test_mla_cache_bytes() -> None:
    assert mla.check_mla_cache_bytes(right_bytes)
    result = mla.check_mla_cache_bytes(lambda *a: 2 * right_bytes(*a))
    assert not result and "one latent row per token" in result.message
    spec_answer = mla.check_mla_cache_bytes(
        lambda layers, rank, rope, tokens: MLAAttentionSpec(1, 1, rank + rope, torch.bfloat16).page_size_bytes
        * tokens * layers)
    assert not spec_answer and "MLAAttentionSpec.page_size_bytes" in spec_answer.message


def test_decode_split() -> None:
    assert mla.check_decode_split(right_split)
    every_one_token = mla.check_decode_split(lambda lens: (lens.count(1), len(lens) - lens.count(1),
                                                           lens.count(1), sum(n for n in lens if n != 1)))
    assert not every_one_token and "LEADING" in every_one_token.message
    assert not mla.check_decode_split(split_decodes_and_prefills)

    def two_is_a_decode(lens: list[int]) -> tuple[int, int, int, int]:
        k = next((i for i, n in enumerate(lens) if n > 2), len(lens))
        return k, len(lens) - k, sum(lens[:k]), sum(lens[k:])

    wrong = mla.check_decode_split(two_is_a_decode, num_hidden=0)  # the fixed case [1, 2, 1]: 2s are rare at random
    assert not wrong and "fn([1, 2, 1])" in wrong.message


def test_absorbed_query() -> None:
    assert mla.check_absorbed_query(lambda q, w: torch.einsum("hn,hnl->hl", q, w))
    wrong = mla.check_absorbed_query(lambda q, w: torch.einsum("hn,hnl->hl", q, w.flip(0)))
    assert not wrong and "differs" in wrong.message
    assert not mla.check_absorbed_query(lambda q, w: q)

    def into_float32(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # right, but rounded
        out = torch.zeros(q.shape[0], w.shape[2])
        for h in range(q.shape[0]):
            out[h] = w[h].T @ q[h]
        return out

    rounded = mla.check_absorbed_query(into_float32)
    assert not rounded and "returned torch.float32" in rounded.message and "dtype=q_nope.dtype" in rounded.message
