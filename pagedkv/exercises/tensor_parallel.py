"""Notebook 10 (tensor parallelism): checkers for which heads a rank holds and its KV cache size.

Each checker runs the student's function on the public shapes the notebook names, then on random
geometries it makes up (head counts, rank counts and head sizes no preset has), all before it works
out any answer; only then does it read the expected heads and sizes off the package's real layout and
KV cache spec. An answer that calls the layout functions, builds the layers or asks a spec for its size
is turned away. A wrong answer is told which rule it broke, never the expected value: `reveal()`
works the failing case out, after three tries.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.exercises.model_file import build_attention
from pagedkv.kv_cache.spec import KVCacheSpec, MLAAttentionSpec
from pagedkv.models.layers import head_layout, rank_heads
from pagedkv.models.llama import LlamaAttention
from pagedkv.models.parallel_layers import QKVParallelLinear

SHOWN_CASES: list[tuple[int, int, int]] = [(32, 8, 2), (32, 8, 4), (64, 8, 16), (28, 4, 4), (32, 1, 8)]
"""(query heads, KV heads, tp) the notebook names: Llama-3-8B at 2 and 4, Llama-3-70B at 16 (KV heads
replicated), Qwen2-7B at 4, an MQA model at 8."""

PACKAGE: list[Callable[..., Any]] = [
    head_layout,
    rank_heads,
    build_attention,
    LlamaAttention.__init__,
    QKVParallelLinear.__init__,
    vars(KVCacheSpec)["page_size_bytes"].fget,  # the properties' getters (vars: the property objects)
    vars(MLAAttentionSpec)["page_size_bytes"].fget,
]
"""What an answer may not call: the layout it is asked for, and every way to build or size it."""

RankHeadsFn = Callable[[int, int, int, int], Any]
KvBytesFn = Callable[[int, int, int, int, int, int], Any]


def _geometries(num_hidden: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """SHOWN_CASES, then `num_hidden` random (query heads, KV heads, tp) that split: KV heads split
    evenly or replicate evenly, counts like 3, 5, 6 or 12 that no public model has among them."""
    found: list[tuple[int, int, int]] = []
    while len(found) < num_hidden:
        hkv = rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 16])
        tp = rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
        hq = hkv * rng.choice([1, 2, 3, 4, 6, 8]) * (tp // hkv if tp > hkv else 1)
        if hq % tp == 0 and ((hkv >= tp and hkv % tp == 0) or (hkv < tp and tp % hkv == 0)):
            found.append((hq, hkv, tp))
    return SHOWN_CASES + found


@exercise("10: the heads of a rank")
def check_rank_heads(fn: RankHeadsFn, num_hidden: int = 12) -> CheckResult:
    """`fn(num_heads, num_kv_heads, tp_size, rank)` -> (query heads, KV heads) of that rank, as
    global head indices, for every rank of every geometry (the notebook's, then made-up ones)."""
    own = package_answer(fn, PACKAGE, "the layout")
    if own is not None:
        return own
    cases = [(hq, hkv, tp, rank) for hq, hkv, tp in _geometries(num_hidden, random.Random()) for rank in range(tp)]
    results, rejected = call_on_cases(fn, cases, PACKAGE, "the layout", lambda case: f"fn{case}")
    if rejected is not None:
        return rejected
    for (hq, hkv, tp, rank), got in zip(cases, results):  # every answer is in: now the expected heads
        call = f"fn({hq}, {hkv}, {tp}, {rank})"
        try:  # plain lists of ints (a list, tuple, range or tensor of them): their own == takes no part
            q, kv = plain(got, ([0], [0]))
        except TypeError as error:
            return CheckResult(
                False, f"{call} must return (query heads, KV heads), two lists of head indices (ints): {error}."
            )
        layout = head_layout(hq, hkv, tp)
        want_q, want_kv = (list(heads) for heads in rank_heads(layout, rank))

        def worked(
            hq: int = hq,
            hkv: int = hkv,
            tp: int = tp,
            rank: int = rank,
            want_q: list[int] = want_q,
            want_kv: list[int] = want_kv,
        ) -> str:
            per_rank, group = hq // tp, hq // hkv
            q_first = rank * per_rank
            lines = [
                f"query heads: {hq} / {tp} ranks = {per_rank} per rank, in order: rank {rank} holds "
                f"{q_first} .. {q_first + per_rank - 1}"
            ]
            if hkv >= tp:
                kv_per_rank = hkv // tp
                lines.append(
                    f"KV heads: {hkv} >= {tp} ranks, so they split too: {kv_per_rank} per rank, rank "
                    f"{rank} holds {rank * kv_per_rank} .. {(rank + 1) * kv_per_rank - 1}"
                )
            else:
                replicas = tp // hkv
                lines.append(
                    f"KV heads: {hkv} < {tp} ranks, so each rank keeps one, replicated on {tp} / {hkv} = "
                    f"{replicas} ranks; query head {q_first} attends to KV head {q_first} // ({hq} / {hkv})"
                    f" = {q_first // group}, which rank {rank} keeps (= rank // {replicas})"
                )
            return "\n".join(lines) + f"\nfn({hq}, {hkv}, {tp}, {rank}) = ({want_q}, {want_kv})"

        if q != want_q:
            hint = (
                "they are global indices (0 .. num_heads - 1), not this rank's local 0, 1, ..."
                if q == list(range(len(q))) and rank > 0
                else "query heads always split evenly and in order: num_heads / tp_size consecutive heads per rank"
            )
            return CheckResult(False, f"{call}: the query heads {q} are not rank {rank}'s; {hint}.", reveal=worked)
        if kv != want_kv:
            if hkv < tp:
                hint = (
                    f"{hkv} KV head(s) over {tp} ranks: each rank keeps ONE KV head, replicated on {tp // hkv} "
                    "ranks, the one its query heads attend to (query head h attends to KV head "
                    "h // (num_heads / num_kv_heads))"
                )
            else:
                hint = f"{hkv} KV heads split over {tp} ranks like the query heads: evenly, in order"
            return CheckResult(False, f"{call}: the KV heads {kv} are not rank {rank}'s; {hint}.", reveal=worked)
    return CheckResult(
        True, f"Every rank of {len(SHOWN_CASES)} public shapes and {num_hidden} made-up ones holds the heads you said."
    )


@exercise("10: one rank's KV cache bytes")
def check_kv_cache_bytes(fn: KvBytesFn, num_hidden: int = 12) -> CheckResult:
    """`fn(num_layers, num_heads, num_kv_heads, head_dim, tp_size, num_blocks)` -> bytes of KV
    cache one rank allocates: blocks of 16 tokens in bfloat16. Expected: the block size of the real
    attention layer one rank builds (its KV cache spec), times layers and blocks."""
    own = package_answer(fn, PACKAGE, "the size")
    if own is not None:
        return own
    rng = random.Random()
    cases = [
        (
            rng.choice([2, 3, 27, 32, 80]),
            hq,
            hkv,
            rng.choice([40, 64, 96, 128, 192]),
            tp,
            rng.choice([1, 100, 777, 4096]),
        )
        for hq, hkv, tp in _geometries(num_hidden, rng)
    ]
    results, rejected = call_on_cases(fn, cases, PACKAGE, "the size", lambda case: f"fn{case}")
    if rejected is not None:
        return rejected
    for (layers, hq, hkv, head_dim, tp, blocks), got in zip(cases, results):
        call = f"fn({layers}, {hq}, {hkv}, {head_dim}, {tp}, {blocks})"
        try:
            got = plain(got, 0)  # a plain int: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; return a number of bytes (an int).")
        spec = build_attention(hq, hkv, tp, head_dim, hidden_size=64 * hq).attn.get_kv_cache_spec()
        assert spec is not None  # a decoder's attention layer has a KV cache
        expected = spec.page_size_bytes * layers * blocks
        if got == expected:
            continue
        itemsize = torch.empty((), dtype=spec.dtype).element_size()

        def worked(
            spec: KVCacheSpec = spec,
            layers: int = layers,
            blocks: int = blocks,
            hkv: int = hkv,
            tp: int = tp,
            itemsize: int = itemsize,
            call: str = call,
        ) -> str:
            held = (
                f"{hkv} / {tp} = {spec.num_kv_heads}"
                if hkv >= tp
                else f"1 ({hkv} KV head(s) < {tp} ranks: one, replicated)"
            )
            page = spec.page_size_bytes
            return (
                f"KV heads on one rank: {held}\n"
                f"one block of one layer: 2 (K and V) x {spec.block_size} tokens x {spec.num_kv_heads} KV head(s)"
                f" x {spec.head_size} values x {itemsize} bytes = {page:,} bytes\n"
                f"{call} = {page:,} x {layers} layers x {blocks} blocks = {page * layers * blocks:,}"
            )

        whole = 2 * spec.block_size * hkv * head_dim * itemsize * layers * blocks  # every rank's KV heads
        if got == whole == 2 * expected:
            hint = (
                "twice the size: a rank keeps only its own KV heads (not the whole model's), and a bfloat16 "
                "value takes 2 bytes"
            )
        elif got == whole:
            hint = "that is the whole model's cache: a rank keeps only its own KV heads"
        elif got * 2 == expected:
            hint = "a block holds a K and a V for each of its tokens"
        elif got == expected * 2:
            hint = "bfloat16 values take 2 bytes, and K and V count once each"
        else:
            hint = (
                "per layer and block: K and V, 16 tokens, this rank's KV heads (at least one: a rank among more "
                "ranks than KV heads keeps one), head_dim values of 2 bytes"
            )
        return CheckResult(False, f"{call} = {got!r} is not what one rank allocates; {hint}.", reveal=worked)
    return CheckResult(
        True, f"Your sizes match the cache the real per-rank attention layers ask for, on {len(cases)} geometries."
    )
