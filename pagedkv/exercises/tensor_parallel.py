"""Notebook 10 (tensor parallelism): checkers for which heads a rank holds and its KV cache size.

Each checker draws its own geometries (public checkpoint shapes first, then random ones the
notebook never prints), compares the student's function with what the package's real layers
hold, and turns away answers that call the package's layout functions or build its layers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from pagedkv.exercises import CheckResult, call_answer, package_answer
from pagedkv.exercises.model_file import build_attention
from pagedkv.models.layers import head_layout, rank_heads

# (query heads, KV heads, tp): Llama-3-8B at 2 and 4, Llama-3-70B at 16 (KV heads replicated),
# Qwen2-7B at 4, an MQA model at 8.
SHOWN_CASES: list[tuple[int, int, int]] = [(32, 8, 2), (32, 8, 4), (64, 8, 16), (28, 4, 4), (32, 1, 8)]

RankHeadsFn = Callable[[int, int, int, int], Any]
KvBytesFn = Callable[[int, int, int, int, int, int], Any]


def _cases(num_hidden: int, rng: random.Random) -> Iterator[tuple[int, int, int]]:
    """SHOWN_CASES, then `num_hidden` random valid (query heads, KV heads, tp) triples."""
    yield from SHOWN_CASES
    found = 0
    while found < num_hidden:
        hkv = rng.choice([1, 2, 3, 4, 8, 16])
        hq, tp = hkv * rng.choice([1, 2, 4, 7]), rng.choice([1, 2, 4, 8, 16])
        try:
            head_layout(hq, hkv, tp)
        except ValueError:
            continue
        found += 1
        yield hq, hkv, tp


def _as_heads(value: Any) -> list[int] | None:
    try:
        heads = list(value)
    except TypeError:
        return None
    return heads if all(isinstance(h, int) and not isinstance(h, bool) for h in heads) else None


def check_rank_heads(fn: RankHeadsFn, num_hidden: int = 8) -> CheckResult:
    """`fn(num_heads, num_kv_heads, tp_size, rank)` -> (query heads, KV heads) of that rank, as
    global head indices, checked for every rank of every drawn geometry."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    own = package_answer(fn, [rank_heads, head_layout], "the layout")
    if own is not None:
        return own
    for hq, hkv, tp in _cases(num_hidden, random.Random()):
        layout = head_layout(hq, hkv, tp)
        for rank in range(tp):
            call = f"fn({hq}, {hkv}, {tp}, {rank})"
            got, rejected = call_answer(fn, (hq, hkv, tp, rank), [rank_heads, head_layout], "the layout", call)
            if rejected is not None:
                return rejected
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                return CheckResult(False, f"{call} must return (query heads, KV heads), got {got!r}.")
            q, kv = (_as_heads(part) for part in got)
            want_q, want_kv = (list(r) for r in rank_heads(layout, rank))
            if q != want_q:
                return CheckResult(False, f"{call}: query heads {q}, expected {want_q} (query heads always split "
                                          "evenly, in order).")
            if kv != want_kv:
                hint = (f"with {hkv} KV heads and {tp} ranks each KV head is replicated on {tp // hkv} ranks: "
                        "a rank keeps the one its query heads attend to") if layout.kv_head_replicas > 1 else \
                    f"{hkv} KV heads split {tp} ways, in order"
                return CheckResult(False, f"{call}: KV heads {kv}, expected {want_kv}; {hint}.")
    return CheckResult(True, f"Every rank of {len(SHOWN_CASES)} public shapes and {num_hidden} random ones "
                             "holds the heads you said.")


def check_kv_cache_bytes(fn: KvBytesFn, num_hidden: int = 8) -> CheckResult:
    """`fn(num_layers, num_heads, num_kv_heads, head_dim, tp_size, num_blocks)` -> bytes of KV
    cache one rank allocates: blocks of 16 tokens in bfloat16. The expected value is the block
    size of the real attention layer one rank builds (its KV cache spec), times layers and blocks."""
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself (not its result), got {fn!r}.")
    rng = random.Random()
    for hq, hkv, tp in _cases(num_hidden, rng):
        layers, head_dim, blocks = rng.choice([2, 32, 80]), rng.choice([64, 128]), rng.choice([100, 4096])
        call = f"fn({layers}, {hq}, {hkv}, {head_dim}, {tp}, {blocks})"
        got, rejected = call_answer(fn, (layers, hq, hkv, head_dim, tp, blocks),
                                    [build_attention, head_layout, rank_heads], "the size", call)
        if rejected is not None:
            return rejected
        spec = build_attention(hq, hkv, tp, head_dim, hidden_size=64 * hq).attn.get_kv_cache_spec()
        expected = spec.page_size_bytes * layers * blocks
        if got != expected:
            whole = 2 * spec.block_size * hkv * head_dim * 2 * layers * blocks
            hint = ("that is the whole model's cache: a rank keeps only its KV heads" if got == whole else
                    f"per layer and block: K and V, {spec.block_size} tokens, {spec.num_kv_heads} KV head(s) on "
                    f"this rank, {head_dim} values of 2 bytes")
            return CheckResult(False, f"{call} = {got!r}, expected {expected:,}; {hint}.")
    return CheckResult(True, "Your sizes match the cache the real per-rank attention layers ask for, on "
                             f"{len(SHOWN_CASES) + num_hidden} geometries.")
