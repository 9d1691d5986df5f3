"""Notebook 11 (MLA): checkers for the latent cache size, the decode/prefill split and the
absorption of W_UK into the query.

Each draws its own cases (public DeepSeek shapes first, then random ones the notebook never
prints), computes the expected value from the package's real pieces (the KV cache spec, the
builder's split) or from a float64 computation, and turns away answers that call those pieces.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.mla.common import split_decodes_and_prefills
from pagedkv.exercises import CheckResult, call_answer, package_answer
from pagedkv.kv_cache.spec import MLAAttentionSpec

# (layers, kv_lora_rank, qk_rope_head_dim): DeepSeek-V2-Lite, DeepSeek-V2 / V3 (27 / 60 / 61 layers).
SHOWN_SHAPES: list[tuple[int, int, int]] = [(27, 512, 64), (60, 512, 64), (61, 512, 64)]

_SPEC_SIZE = MLAAttentionSpec.page_size_bytes.fget  # what the cache manager sizes blocks with


def check_mla_cache_bytes(fn: Callable[[int, int, int, int], Any], num_hidden: int = 8) -> CheckResult:
    """`fn(num_layers, kv_lora_rank, qk_rope_head_dim, num_tokens)` -> bytes of bfloat16 MLA cache
    that `num_tokens` tokens take in all layers; expected from the real `MLAAttentionSpec`."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    rng = random.Random()
    cases = SHOWN_SHAPES + [(rng.randint(2, 80), rng.choice([64, 256, 512]), rng.choice([16, 32, 64]))
                            for _ in range(num_hidden)]
    for layers, rank, rope in cases:
        tokens = rng.choice([1, 16, 4096, 100_000])
        call = f"fn({layers}, {rank}, {rope}, {tokens})"
        got, rejected = call_answer(fn, (layers, rank, rope, tokens), [_SPEC_SIZE], "the size", call)
        if rejected is not None:
            return rejected
        spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=rank + rope, dtype=torch.bfloat16)
        expected = spec.page_size_bytes // spec.block_size * tokens * layers
        if got != expected:
            hint = ("that counts a K and a V: MLA caches one latent row per token, the values are the c_kv part "
                    "of the same row" if got == 2 * expected else
                    f"per token and layer one row of kv_lora_rank + rope = {rank + rope} values of 2 bytes")
            return CheckResult(False, f"{call} = {got!r}, expected {expected:,}; {hint}.")
    return CheckResult(True, f"Your sizes match MLAAttentionSpec on {len(cases)} shapes.")


def _common(query_lens: list[int]) -> CommonAttentionMetadata:
    """Just enough metadata for `split_decodes_and_prefills`: lengths on the host."""
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=empty, seq_lens_cpu=empty,
        num_reqs=len(query_lens), num_actual_tokens=sum(query_lens), max_query_len=max(query_lens, default=0),
        max_seq_len=0, block_table_tensor=empty, slot_mapping=empty,
    )


SHOWN_SPLITS: list[list[int]] = [[1, 1, 1, 7], [5, 1, 1], [1, 1, 1], [1, 4, 1, 3]]


def check_decode_split(fn: Callable[[list[int]], Any], num_hidden: int = 12) -> CheckResult:
    """`fn(query_lens)` -> (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a
    batch whose requests have these query lengths, split as the MLA builder splits it."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    own = package_answer(fn, [split_decodes_and_prefills], "the split")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_SPLITS + [[1, 2, 1]] + [  # [1, 2, 1]: query length 2 is a prefill, rarely drawn below
        [1] * rng.randint(0, 5) + [rng.choice([1, rng.randint(2, 40)]) for _ in range(rng.randint(1, 4))]
        for _ in range(num_hidden)
    ]
    for lens in cases:
        call = f"fn({lens})"
        got, rejected = call_answer(fn, (list(lens),), [split_decodes_and_prefills], "the split", call)
        if rejected is not None:
            return rejected
        expected = split_decodes_and_prefills(_common(lens))
        if not isinstance(got, (tuple, list)) or tuple(got) != expected:
            return CheckResult(False, f"{call} = {got!r}, expected {expected}; the decodes are the LEADING requests "
                                      "with one query token, everything from the first longer one is a prefill.")
    return CheckResult(True, f"Your split matches the MLA builder's on {len(cases)} batches.")


def check_absorbed_query(fn: Callable[[torch.Tensor, torch.Tensor], Any], num_hidden: int = 4) -> CheckResult:
    """`fn(q_nope [heads, nope], W_UK [heads, nope, kv_lora_rank])` -> ql_nope [heads, kv_lora_rank]
    such that ql_nope[h] . c == q_nope[h] . (W_UK[h] @ c) for every latent c (checked in float64)."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    g = torch.Generator().manual_seed(random.randrange(2**31))
    for i in range(1 + num_hidden):
        heads, nope, rank = (16, 128, 512) if i == 0 else (int(torch.randint(1, 9, (1,), generator=g)), 8, 24)
        q = torch.randn(heads, nope, generator=g, dtype=torch.float64)
        w_uk = torch.randn(heads, nope, rank, generator=g, dtype=torch.float64)
        call = f"fn(q_nope {list(q.shape)}, W_UK {list(w_uk.shape)})"
        got, rejected = call_answer(fn, (q.clone(), w_uk.clone()), [], "the absorption", call)
        if rejected is not None:
            return rejected
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (heads, rank):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return CheckResult(False, f"{call} must return a tensor [heads, kv_lora_rank] = [{heads}, {rank}], got {shape}.")
        c = torch.randn(rank, 5, generator=g, dtype=torch.float64)
        want = torch.einsum("hn,hnl,ls->hs", q, w_uk, c)  # q_nope . (W_UK c), five latents
        if got.dtype != torch.float64:  # an exact answer rounded to float32 would fail the 1e-6 below
            return CheckResult(False, f"{call} returned {got.dtype}; the inputs are float64: keep their dtype "
                                      "(torch.zeros(...) is float32 unless you pass dtype=q_nope.dtype).")
        if not torch.allclose(got @ c, want, rtol=1e-6, atol=1e-6):
            return CheckResult(False, f"{call}: ql_nope . c differs from q_nope . (W_UK c); ql_nope[h] = W_UK[h]^T q_nope[h].")
    return CheckResult(True, "Your absorbed queries score every latent exactly as the up-projected keys do.")
