"""Notebook 11 (MLA): checkers for the latent cache size, the decode/prefill split and the query
that `forward_mqa` takes (W_UK absorbed, from the loaded kv_b_proj weight).

Each runs the student's function on the public DeepSeek shapes first, then on cases it makes up
(latent sizes, head counts and batches no preset has), all before it works out any answer; only
then does it compute the expected value, from the package's real pieces (the KV cache spec, the
builder's split) or in float64. Answers that call those pieces are turned away, and a wrong answer
is told which rule it broke, never the expected value: `reveal()` works the failing case out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.mla.common import MLACommonImpl, MLACommonMetadataBuilder, split_decodes_and_prefills
from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.kv_cache.spec import KVCacheSpec, MLAAttentionSpec

SHOWN_SHAPES: list[tuple[int, int, int]] = [(27, 512, 64), (60, 512, 64), (61, 512, 64)]
"""(layers, kv_lora_rank, qk_rope_head_dim) the notebook names: DeepSeek-V2-Lite, V2, V3."""

SPEC_SIZES: list[Callable[..., Any]] = [  # the properties' getters (vars: the property objects themselves)
    vars(MLAAttentionSpec)["page_size_bytes"].fget,
    vars(KVCacheSpec)["page_size_bytes"].fget,
]
"""What the cache manager sizes blocks with: an answer may not ask it."""


@exercise("11: the size of an MLA cache")
def check_mla_cache_bytes(fn: Callable[[int, int, int, int], Any], num_hidden: int = 8) -> CheckResult:
    """`fn(num_layers, kv_lora_rank, qk_rope_head_dim, num_tokens)` -> bytes of bfloat16 MLA cache
    that `num_tokens` tokens take in all layers; expected from the real `MLAAttentionSpec`."""
    own = package_answer(fn, SPEC_SIZES, "the size")
    if own is not None:
        return own
    rng = random.Random()
    shapes = SHOWN_SHAPES + [
        (rng.randint(2, 95), rng.choice([96, 160, 192, 320, 448]), rng.choice([16, 24, 48])) for _ in range(num_hidden)
    ]
    cases = [(layers, rank, rope, rng.choice([1, 17, 4096, 100_003])) for layers, rank, rope in shapes]
    results, rejected = call_on_cases(fn, cases, SPEC_SIZES, "the size", lambda case: f"fn{case}")
    if rejected is not None:
        return rejected
    for (layers, rank, rope, tokens), got in zip(cases, results):
        call = f"fn({layers}, {rank}, {rope}, {tokens})"
        try:
            got = plain(got, 0)  # a plain int: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; return a number of bytes (an int).")
        spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=rank + rope, dtype=torch.bfloat16)
        per_token = spec.page_size_bytes // spec.block_size
        if got == per_token * tokens * layers:
            continue

        def worked(
            layers: int = layers,
            rank: int = rank,
            rope: int = rope,
            tokens: int = tokens,
            per_token: int = per_token,
            call: str = call,
        ) -> str:
            return (
                f"one token, one layer: one latent row [c_kv | k_pe] = {rank} + {rope} = {rank + rope} values "
                f"x 2 bytes (bfloat16) = {per_token:,} bytes\n"
                f"{call} = {per_token:,} x {tokens:,} tokens x {layers} layers = {per_token * tokens * layers:,}"
            )

        if got == 2 * per_token * tokens * layers:
            hint = (
                "twice the size: MLA caches ONE latent row per token (no K and V pair: the values come from the "
                "c_kv part of the same row), and bfloat16 takes 2 bytes"
            )
        elif got == 2 * rank * tokens * layers:
            hint = "the row also holds k_pe, the positional key shared by all heads"
        elif got == -(-tokens // 16) * 16 * per_token * layers and tokens % 16:
            hint = "count the tokens' rows, not the whole blocks they would take"
        else:
            hint = "per token and layer the cache holds one row of kv_lora_rank + qk_rope_head_dim values, 2 bytes each"
        return CheckResult(False, f"{call} = {got!r} is not the size; {hint}.", reveal=worked)
    return CheckResult(True, f"Your sizes match MLAAttentionSpec on {len(cases)} shapes.")


def _common(query_lens: list[int]) -> CommonAttentionMetadata:
    """Just enough metadata for `split_decodes_and_prefills`: lengths on the host."""
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=empty,
        seq_lens_cpu=empty,
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=0,
        block_table_tensor=empty,
        slot_mapping=empty,
    )


SHOWN_SPLITS: list[list[int]] = [[1, 1, 1, 7], [5, 1, 1], [1, 1, 1], [1, 4, 1, 3]]
"""Batches (query length per request) the notebook may print."""
SPLITTERS: list[Callable[..., Any]] = [
    split_decodes_and_prefills,
    MLACommonMetadataBuilder.build,
    MLACommonMetadataBuilder.build_for_cudagraph_capture,
]


@exercise("11: the decode / prefill split")
def check_decode_split(fn: Callable[[list[int]], Any], num_hidden: int = 12) -> CheckResult:
    """`fn(query_lens)` -> (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a
    batch whose requests have these query lengths, split as the MLA builder splits it."""
    own = package_answer(fn, SPLITTERS, "the split")
    if own is not None:
        return own
    rng = random.Random()
    # [1, 2, 1]: a query of 2 tokens is a prefill (rarely drawn below); then made-up batches, some of
    # them with one-token requests after a longer one.
    cases = (
        SHOWN_SPLITS
        + [[1, 2, 1]]
        + [
            [1] * rng.randint(0, 5) + [rng.choice([1, rng.randint(2, 40)]) for _ in range(rng.randint(1, 5))]
            for _ in range(num_hidden)
        ]
    )
    results, rejected = call_on_cases(
        fn, [(list(lens),) for lens in cases], SPLITTERS, "the split", lambda case: f"fn({case[0]})"
    )
    if rejected is not None:
        return rejected
    for lens, got in zip(cases, results):
        call = f"fn({lens})"
        try:
            got = plain(got, (0, 0, 0, 0))  # plain ints: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(
                False,
                f"{call}: {error}; return four ints (num_decodes, num_prefills, "
                "num_decode_tokens, num_prefill_tokens).",
            )
        expected = split_decodes_and_prefills(_common(lens))
        if got == tuple(expected):
            continue
        decodes = expected[0]

        def worked(lens: list[int] = lens, decodes: int = decodes, expected: tuple[int, ...] = expected) -> str:
            first = (
                f"request {decodes} is the first with more than one query token ({lens[decodes]})"
                if decodes < len(lens)
                else "every request has one query token"
            )
            leading = f"requests 0 .. {decodes - 1} are the decodes" if decodes else "there is no decode"
            return (
                f"query lengths {lens}: {first}, so {leading} ({decodes} requests, {expected[2]} tokens) and "
                f"the other {expected[1]} requests, {' + '.join(map(str, lens[decodes:])) or '0'} = "
                f"{expected[3]} tokens, are the prefills\n"
                f"fn({lens}) = {expected}"
            )

        ones = [i for i, n in enumerate(lens) if n == 1]
        if got[0] + got[1] != len(lens):
            hint = "every request is a decode or a prefill: the first two numbers add up to the number of requests"
        elif tuple(got[:2]) == expected[:2]:
            hint = (
                "the requests are split right; the last two numbers count the query tokens of the decodes and of "
                "the prefills"
            )
        elif got[0] == len(ones):
            hint = (
                "the decodes are the LEADING requests with one query token: from the first longer request on, "
                "everything is a prefill, one-token requests after it too"
            )
        elif got[0] > decodes:
            hint = "a decode has ONE query token: a request with 2 or more is a prefill (a prompt or a chunk of one)"
        else:
            hint = "the decodes are the leading requests with one query token; the split falls where they end"
        return CheckResult(False, f"{call} = {tuple(got)} is not the builder's split; {hint}.", reveal=worked)
    return CheckResult(True, f"Your split matches the MLA builder's on {len(cases)} batches.")


MQA_QUERY: list[Callable[..., Any]] = [MLACommonImpl.process_weights_after_loading, MLACommonImpl.forward]
"""The package's split of kv_b_proj and its absorption: an answer may not call them."""


@exercise("11: the query of forward_mqa")
def check_absorbed_query(fn: Callable[[torch.Tensor, torch.Tensor, int], Any], num_hidden: int = 5) -> CheckResult:
    """`fn(q [tokens, heads, qk_nope_head_dim + qk_rope_head_dim], kv_b_weight [heads * (qk_nope_head_dim +
    v_head_dim), kv_lora_rank], qk_nope_head_dim)` -> the query `forward_mqa` takes, [tokens, heads,
    kv_lora_rank + qk_rope_head_dim]: it must score every cached row [c | k_pe] exactly as the query
    scores the up-projected key [W_UK[h] @ c | k_pe] (checked in float64)."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    g = torch.Generator().manual_seed(random.randrange(2**31))

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    # (tokens, heads, nope, rope, v, rank): DeepSeek-V2-Lite's attention, then made-up shapes whose
    # v_head_dim differs from qk_nope_head_dim, so W_UK and W_UV cannot be mistaken for each other.
    shapes = [(2, 16, 128, 64, 128, 512)] + [
        (draw(1, 3), draw(1, 6), nope, 2 * draw(2, 6), nope + draw(1, 4) * (1 if draw(0, 1) else -1), draw(20, 40))
        for nope in (draw(8, 24) for _ in range(num_hidden))
    ]
    cases = []
    for tokens, heads, nope, rope, v, rank in shapes:
        q = torch.randn(tokens, heads, nope + rope, generator=g, dtype=torch.float64)
        w = torch.randn(heads * (nope + v), rank, generator=g, dtype=torch.float64)
        cases.append((q, w, nope))
    results, rejected = call_on_cases(
        fn,
        [(q.clone(), w.clone(), nope) for q, w, nope in cases],
        MQA_QUERY,
        "the absorption",
        lambda c: f"fn(q {list(c[0].shape)}, kv_b_weight {list(c[1].shape)}, {c[2]})",
    )
    if rejected is not None:
        return rejected
    for (tokens, heads, nope, rope, v, rank), (q, w, _), got in zip(shapes, cases, results):
        call = f"fn(q {list(q.shape)}, kv_b_weight {list(w.shape)}, {nope})"
        try:  # a plain tensor: a subclass's __torch_function__ could answer the comparisons below
            got = plain(got, q)
        except TypeError as error:
            return CheckResult(
                False, f"{call}: {error}; return a tensor [tokens, heads, kv_lora_rank + qk_rope_head_dim]."
            )
        if tuple(got.shape) != (tokens, heads, rank + rope):
            shape = list(got.shape)
            return CheckResult(
                False,
                f"{call} returned {shape}: return a tensor [tokens, heads, kv_lora_rank + "
                f"qk_rope_head_dim], the shape of a cached row per head.",
            )
        if got.dtype != torch.float64:
            return CheckResult(
                False,
                f"{call} returned {got.dtype}; the inputs are float64: keep their dtype "
                "(torch.zeros(...) is float32 unless you pass dtype=q.dtype).",
            )
        # Every answer is in: score random cached rows both ways.
        c = torch.randn(7, rank, generator=g, dtype=torch.float64)
        k_pe = torch.randn(7, rope, generator=g, dtype=torch.float64)
        w_uk = w.view(heads, nope + v, rank)[:, :nope]  # each head's block of rows: [W_UK[h]; W_UV[h]]
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent_ok = torch.allclose(
            torch.einsum("thl,sl->ths", got[..., :rank], c),
            torch.einsum("thn,hnl,sl->ths", q_nope, w_uk, c),
            rtol=1e-6,
            atol=1e-6,
        )
        rope_ok = torch.allclose(got[..., rank:] @ k_pe.T, q_pe @ k_pe.T, rtol=1e-6, atol=1e-6)
        if latent_ok and rope_ok:
            continue

        def worked(
            heads: int = heads, nope: int = nope, rope: int = rope, v: int = v, rank: int = rank, call: str = call
        ) -> str:
            return (
                f"kv_lora_rank = kv_b_weight.shape[1] = {rank}; qk_rope_head_dim = q.shape[-1] - {nope} = {rope}; "
                f"v_head_dim = kv_b_weight.shape[0] / {heads} heads - {nope} = {v}\n"
                f"W_UK = kv_b_weight.view({heads}, {nope} + {v}, {rank})[:, :{nope}]   # [heads, nope, rank]\n"
                f"q_nope, q_pe = q.split([{nope}, {rope}], dim=-1)\n"
                "ql_nope = torch.einsum('thn,hnl->thl', q_nope, W_UK)   # W_UK[h]^T q_nope, once per query\n"
                f"{call} = torch.cat([ql_nope, q_pe], dim=-1)   # [tokens, heads, {rank} + {rope}]"
            )

        if not latent_ok:
            hint = (
                "its first kv_lora_rank values do not score c as q_nope scores W_UK[h] @ c. kv_b_weight holds, "
                "head after head, W_UK[h] (qk_nope_head_dim rows) then W_UV[h] (v_head_dim rows); "
                "the absorbed part is W_UK[h]^T q_nope[h]"
            )
        else:
            hint = (
                "its last qk_rope_head_dim values do not score k_pe as q_pe does: k_pe is shared by all heads "
                "and not up-projected, so that part of the query stays q_pe, after the latent part (the "
                "cached row is [c | k_pe])"
            )
        return CheckResult(False, f"{call}: the query you built: {hint}.", reveal=worked)
    return CheckResult(
        True, f"Your queries score every latent row as the up-projected keys do, on {len(shapes)} shapes."
    )
