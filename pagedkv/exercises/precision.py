"""Notebook 14 (precision and determinism): checkers for a split-KV rule that keeps one request's attention
row bitwise the same in every batch, and for the KV cache blocks that fit in a memory budget.

    check_num_splits(fn)   fn(seq_len, batch_size, num_sms) -> how many programs share one request's keys
    check_num_blocks(fn)   fn(memory_bytes, config, block_size, kv_cache_dtype) -> the blocks the engine allocates

Functions are run on the notebook's cases and on cases made up per call, all before anything is worked
out. The split rule is then judged by running `split_kv_attention` (the split-KV kernel's arithmetic in
float32 torch) with the counts it gave; the block count is compared with the engine's own `KVCacheSpec`
pages summed by `get_kv_cache_config`, which an answer may not call. A wrong answer gets the rule it broke,
never the value; `reveal()` works the failing case out after three tries.
"""

from __future__ import annotations

import copy
import functools
import random
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from pagedkv.config import parse_kv_cache_dtype
from pagedkv.exercises import CheckResult, call_on_cases, exercise, package_answer, plain
from pagedkv.exercises.watch import functions_of
from pagedkv.kernels import attention_config
from pagedkv.kernels.attention_config import MAX_SPLITS
from pagedkv.kernels.common import cdiv
from pagedkv.kv_cache import spec as kv_cache_spec
from pagedkv.kv_cache.spec import FullAttentionSpec, KVCacheSpec, get_kv_cache_config
from pagedkv.models.configs import LlamaConfig
from pagedkv.models.loader import PRESETS

KEYS_PER_TILE = 16
"""Keys per K/V tile of the split-KV model (the kernel's block_n in float32)."""
SPLIT_KV_MIN_KEYS = 1024
"""A lone request from this many keys must keep split-KV (at least 2 splits)."""
FIXED_SPLIT_KEYS = 256
"""The split size of the reveal's example rule."""


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int) -> torch.Tensor:
    """One decode row's attention as the split-KV kernel computes it: q [heads, D], k and v [keys, heads, D].

    The keys go in tiles of KEYS_PER_TILE; split s takes the s-th run of cdiv(tiles, num_splits) tiles and
    returns its own softmax-normalised output o_s and log-sum-exp lse_s; the merge mixes them with weights
    exp(lse_s - lse) (pagedkv/kernels/split_kv.py). Exact arithmetic would give the same row for every
    count; float arithmetic sums in another order for each, so the last bits differ."""
    scale = q.shape[-1] ** -0.5
    per_split = cdiv(cdiv(k.shape[0], KEYS_PER_TILE), num_splits) * KEYS_PER_TILE
    outs, lses = [], []
    for start in range(0, k.shape[0], per_split):  # splits past the last key are empty: weight 0
        scores = torch.einsum("hd,khd->hk", q, k[start : start + per_split]) * scale
        lse = scores.logsumexp(-1)
        outs.append(torch.einsum("hk,khd->hd", (scores - lse[:, None]).exp(), v[start : start + per_split]))
        lses.append(lse)
    lse_s = torch.stack(lses)  # [splits, heads]
    weights = (lse_s - lse_s.logsumexp(0)).exp()
    return (weights[..., None] * torch.stack(outs)).sum(0)


# ---- exercise 1: a split count that keeps a request's row the same in every batch --------------------

SplitCase = tuple[int, int]
SHOWN_SPLIT_CASES: list[SplitCase] = [(10, 132), (200, 132), (1500, 132), (4096, 8)]
"""(seq_len, num_sms) cases the notebook can print: a request of seq_len keys on a GPU of num_sms SMs."""
BATCH_SIZES = [1, 2, 8, 33, 64, 256, 1024]
"""The batches each request runs in: alone, then among batch_size - 1 others."""


def _package(module: ModuleType) -> list[Callable[..., Any]]:
    """What an answer may not hand the work to: every function of `module` (the split rules of the
    kernels' config, or the KV cache specs and their page sizes), methods and properties included,
    and this module's own (its example rule, its sizing), but the helpers the notebook hands out."""
    mine = functions_of(sys.modules[__name__], but=[max_splits, split_kv_attention])
    return [*functions_of(module), *mine]


def max_splits(seq_len: int) -> int:
    """The largest valid split count: every split gets a tile of keys, and the workspace holds MAX_SPLITS."""
    return min(MAX_SPLITS, cdiv(seq_len, KEYS_PER_TILE))


def _random_split_case(rng: random.Random) -> SplitCase:
    return rng.choice([rng.randint(1, 300), rng.randint(300, 8192)]), rng.choice([8, 78, 108, 132])


def _row(seq_len: int, num_splits: int) -> torch.Tensor:
    """The request's attention row (4 heads of 32, float32, the same made-up q/k/v for a seq_len)."""
    g = torch.Generator().manual_seed(seq_len)
    q, k, v = (torch.randn(*shape, 4, 32, generator=g) for shape in [(), (seq_len,), (seq_len,)])
    return split_kv_attention(q, k, v, num_splits)


def _fixed_size_rule(seq_len: int) -> int:
    return min(MAX_SPLITS, cdiv(seq_len, FIXED_SPLIT_KEYS))


def _fixed_size_example(seq_len: int) -> str:
    return f"e.g. min({MAX_SPLITS}, cdiv({seq_len}, {FIXED_SPLIT_KEYS})) = {_fixed_size_rule(seq_len)} splits"


@exercise("14: a batch-invariant split count")
def check_num_splits(fn: Callable[[int, int, int], Any], num_hidden: int = 12) -> CheckResult:
    """`fn(seq_len, batch_size, num_sms)` -> the split count of a decode of seq_len keys in a batch of
    batch_size requests on a GPU of num_sms SMs. It must be valid (1 to `max_splits(seq_len)`), give the
    request's attention row bitwise the same in every batch, and keep split-KV (>= 2 splits) for a lone
    request of SPLIT_KV_MIN_KEYS keys or more."""
    package = _package(attention_config)
    own = package_answer(fn, package, "the split rule")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_SPLIT_CASES + [_random_split_case(rng) for _ in range(num_hidden)]
    calls = [(n, b, sms) for n, sms in cases for b in BATCH_SIZES]
    results, rejected = call_on_cases(fn, calls, package, "the split rule", lambda c: f"fn{tuple(c)}")
    if rejected is not None:
        return rejected
    counts = {}
    for (n, b, sms), got in zip(calls, results):
        try:  # plain ints: an answer's own == takes no part in the comparisons
            counts[(n, b, sms)] = got = plain(got, 0)
        except TypeError:
            pass
        if type(got) is not int or not 1 <= got <= max_splits(n):
            tiles = cdiv(n, KEYS_PER_TILE)
            return CheckResult(
                False,
                f"fn({n}, {b}, {sms}) = {got!r} is not a split count for {n} keys ({tiles} tile(s) of "
                f"{KEYS_PER_TILE}): return an int from 1 to {max_splits(n)} (each split needs at least one tile "
                f"of keys, and the workspace holds {MAX_SPLITS} splits).",
            )
    for n, sms in cases:
        alone = counts[(n, 1, sms)]
        other = next((b for b in BATCH_SIZES if counts[(n, b, sms)] != alone), None)
        if other is not None:
            row_alone, row_batched = _row(n, alone), _row(n, counts[(n, other, sms)])
            differ = int((row_alone != row_batched).sum())
            seen = (
                f"the request's attention row differs in {differ} of {row_alone.numel()} values (max |diff| "
                f"{(row_alone - row_batched).abs().max().item():.1e})"
                if differ
                else "here the bits happened to agree, elsewhere they do not"
            )

            def worked(n: int = n, sms: int = sms) -> str:
                given = ", ".join(f"batch {b}: {counts[(n, b, sms)]}" for b in BATCH_SIZES)
                return (
                    f"your counts for {n} keys on {sms} SMs: {given}\n"
                    f"a row's bits follow its split count, so the count may depend on the request alone: e.g. a "
                    f"fixed split size of {FIXED_SPLIT_KEYS} keys, min({MAX_SPLITS}, cdiv({n}, {FIXED_SPLIT_KEYS})) "
                    f"= {_fixed_size_rule(n)} in every batch"
                )

            return CheckResult(
                False,
                f"fn({n}, b, {sms}) gives {alone} split(s) alone and {counts[(n, other, sms)]} in a batch of "
                f"{other}: {seen}. Hint: the merge sums the splits' parts, so a row's bits follow its split count; "
                "what else is in the batch must not change it.",
                reveal=worked,
            )
    for n, sms in cases:
        if n >= SPLIT_KV_MIN_KEYS and counts[(n, 1, sms)] < 2:
            return CheckResult(
                False,
                f"fn({n}, 1, {sms}) = 1: a lone request of {n} keys runs on one program per KV head, most of the "
                f"{sms} SMs idle. Keep split-KV: at least 2 splits from {SPLIT_KV_MIN_KEYS} keys (1 split everywhere "
                "is invariant too: the engine's batch-invariant mode does that; here, keep the splits).",
                reveal=functools.partial(_fixed_size_example, n),
            )
    return CheckResult(
        True,
        f"Your rule keeps each request's row bitwise the same in batches of {BATCH_SIZES[1]} to {BATCH_SIZES[-1]} on "
        f"{len(cases)} cases, and splits every lone request of {SPLIT_KV_MIN_KEYS}+ keys.",
    )


# ---- exercise 2: the KV cache blocks that fit in a memory budget ---------------------------------------

BlockCase = tuple[int, str, int, str]
SHOWN_BLOCK_CASES: list[BlockCase] = [
    (40 * 2**30, "llama3-8b", 16, "bfloat16"),
    (40 * 2**30, "llama3-8b", 16, "fp8"),
    (3 * 2**30 + 12345, "qwen3-0.6b", 32, "fp8"),
    (64 * 2**20, "tiny", 16, "float32"),
]
"""(memory_bytes, preset, block_size, kv_cache_dtype) cases the notebook can print."""
KV_CACHE_DTYPES = ["bfloat16", "float16", "float32", "fp8", "fp8_e4m3"]


def block_case_config(case: BlockCase | tuple[int, LlamaConfig, int, str]) -> LlamaConfig:
    """The case's model config: a copy of the preset (an answer may not change the preset itself)."""
    config = case[1]
    preset = PRESETS[config] if isinstance(config, str) else config
    assert isinstance(preset, LlamaConfig)  # the cases name Llama-family presets ("tiny")
    return copy.deepcopy(preset)


def _random_block_case(rng: random.Random) -> tuple[int, LlamaConfig, int, str]:
    heads = rng.choice([8, 16, 32, 64])
    config = LlamaConfig(
        hidden_size=heads * rng.choice([64, 128]),
        num_hidden_layers=rng.randint(2, 64),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0]),
        head_dim=rng.choice([None, 64, 96, 128, 256]),  # None: hidden_size // num_attention_heads
    )
    memory = rng.randint(1, 80) * 2**30 + rng.randrange(2**30)
    return memory, config, rng.choice([8, 16, 32, 64, 128]), rng.choice(KV_CACHE_DTYPES)


def _engine_blocks(memory: int, config: LlamaConfig, block_size: int, kv_cache_dtype: str, **field: Any) -> int:
    """`KVCacheConfig.num_blocks` the engine sizes from `memory` for this model (`field` overrides the spec)."""
    dtype = parse_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)
    fields = dict(num_kv_heads=config.num_key_value_heads, head_size=config.head_dim, dtype=dtype) | field
    spec = FullAttentionSpec(block_size=block_size, **fields)
    specs: dict[str, KVCacheSpec] = {f"model.layers.{i}.self_attn.attn": spec for i in range(config.num_hidden_layers)}
    return get_kv_cache_config(specs, memory_bytes=memory).num_blocks


def _block_hint(got: int, memory: int, config: LlamaConfig, block_size: int, kv_cache_dtype: str) -> str:
    right = _engine_blocks(memory, config, block_size, kv_cache_dtype)
    dtype = parse_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)
    itemsize = dtype.itemsize
    mistakes = [
        (got == 2 * right or got == 2 * right + 1, "a block holds K and V: two values per head and channel"),
        (
            got // config.num_hidden_layers == right and config.num_hidden_layers > 1,
            "a block is allocated in every layer: one block of the engine is num_hidden_layers pages",
        ),
        (
            config.num_attention_heads != config.num_key_value_heads
            and got
            == _engine_blocks(memory, config, block_size, kv_cache_dtype, num_kv_heads=config.num_attention_heads),
            "the cache holds the KV heads (num_key_value_heads), not the query heads: grouped-query attention",
        ),
        (
            config.head_dim != config.hidden_size // config.num_attention_heads
            and got
            == _engine_blocks(
                memory, config, block_size, kv_cache_dtype, head_size=config.hidden_size // config.num_attention_heads
            ),
            "a head's size is config.head_dim, which need not be hidden_size // num_attention_heads",
        ),
        (
            itemsize == 1 and got == _engine_blocks(memory, config, block_size, "bfloat16"),
            "an fp8 value takes one byte (float8_e4m3fn), half of bf16's two",
        ),
        (got == right + 1, "a block that only partly fits is not allocated: round down"),
        (
            got == right - 1,
            "count every block the memory holds: the reserved null block (block 0) is one of them",
        ),
        (got == right * block_size, "that is tokens; a block holds block_size of them"),
    ]
    made = [hint for matched, hint in mistakes if matched]
    if made:
        return "; or: ".join(made)
    return (
        "bytes per block = num_hidden_layers x 2 (K, V) x block_size x num_key_value_heads x head_dim x bytes "
        "per value; the blocks are memory_bytes // that"
    )


@exercise("14: the blocks that fit")
def check_num_blocks(fn: Callable[[int, LlamaConfig, int, str], Any], num_hidden: int = 20) -> CheckResult:
    """`fn(memory_bytes, config, block_size, kv_cache_dtype)` -> the number of KV cache blocks the engine
    allocates in memory_bytes (`KVCacheConfig.num_blocks`, the null block included) for a model of this
    config, blocks of block_size tokens, a cache of kv_cache_dtype ("bfloat16", "float16", "float32",
    "fp8" or "fp8_e4m3")."""
    package = _package(kv_cache_spec)
    own = package_answer(fn, package, "the block arithmetic")
    if own is not None:
        return own
    rng = random.Random()
    cases = SHOWN_BLOCK_CASES + [_random_block_case(rng) for _ in range(num_hidden)]
    calls = [(case[0], block_case_config(case), case[2], case[3]) for case in cases]
    results, rejected = call_on_cases(
        fn, calls, package, "the block arithmetic", lambda c: f"fn({c[0]}, <config>, {c[2]}, {c[3]!r})"
    )
    if rejected is not None:
        return rejected
    for case, got in zip(cases, results):
        memory, _, block_size, kv_cache_dtype = case
        config = block_case_config(case)
        name = case[1] if isinstance(case[1], str) else "a model"
        shape = f"{name}: {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads of {config.head_dim}"
        call = f"fn({memory}, <{shape}>, {block_size}, {kv_cache_dtype!r})"
        try:
            got = plain(got, 0)  # a plain int: an answer's own == takes no part in the comparisons
        except TypeError as error:
            return CheckResult(False, f"{call}: {error}; return the number of blocks (an int).")
        if got == _engine_blocks(memory, config, block_size, kv_cache_dtype):
            continue

        def worked(
            memory: int = memory, config: LlamaConfig = config, bs: int = block_size, d: str = kv_cache_dtype
        ) -> str:
            dtype = parse_kv_cache_dtype(d, torch.bfloat16)
            assert config.num_key_value_heads is not None and config.head_dim is not None  # __post_init__ sets them
            page = FullAttentionSpec(bs, config.num_key_value_heads, config.head_dim, dtype).page_size_bytes
            per_block = page * config.num_hidden_layers
            return "\n".join(
                [
                    f"one layer's page: 2 (K, V) x {bs} tokens x {config.num_key_value_heads} KV heads x "
                    f"{config.head_dim} x {dtype.itemsize} byte(s) ({dtype}) = {page} bytes",
                    f"one block in all {config.num_hidden_layers} layers: {per_block} bytes",
                    f"{memory} // {per_block} = {_engine_blocks(memory, config, bs, d)} blocks",
                ]
            )

        hint = _block_hint(got, memory, config, block_size, kv_cache_dtype)
        return CheckResult(False, f"{call} = {got} is not the engine's block count; {hint}.", reveal=worked)
    return CheckResult(True, f"Your block counts match the engine's KV cache sizing on {len(cases)} cases.")
