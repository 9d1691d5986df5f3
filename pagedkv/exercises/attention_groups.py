"""Checkers for notebook 05 (attention groups and metadata): step lengths and sliding-window rows.

Both run the student's function first, on the inputs of real engine steps and on cases the checker
makes up (batches no engine schedules, windows and block sizes of no model, sequences far longer
than any cache), and only then work out the right answers, inside the check.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.engine.events import StepEvent
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, call_on_cases, compare, exercise, package_answer, plain
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.worker.model_runner import ModelRunner

_LENGTHS_PACKAGE: list[Callable[..., Any]] = [
    vars(CommonAttentionMetadata)["query_lens_cpu"].fget,  # the properties' getters (vars: the property objects)
    vars(CommonAttentionMetadata)["context_lens_cpu"].fget,
    ModelRunner.common_attn_metadata,
]
"""What the lengths could be handed off to: CommonAttentionMetadata's own, and the runner's builder of it."""
_WINDOW_PACKAGE: list[Callable[..., Any]] = [
    KVCacheManager.allocate_slots,
    KVCacheManager._allocate,
    KVCacheManager._free_out_of_window,
]
"""What frees the blocks behind the window: a manager run by the student's function would count them for it."""


def _engine_lengths(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(query_start_loc, seq_lens) of every step of a small "tiny-hybrid" run with random prompts:
    prefills, prefill chunks on cached context and decodes, mixed in one batch."""
    llm = LLM(
        "tiny-hybrid",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=rng.choice([8, 12, 16]),
        enable_prefix_caching=False,
    )
    inputs: list[tuple[list[int], list[int]]] = []

    def record(event: StepEvent) -> None:
        batch = event.result.batch
        inputs.append((batch.query_start_loc_cpu.tolist(), batch.seq_lens_cpu.tolist()))

    llm.add_step_listener(record)
    prompts = [[(5 * i + k) % 250 for i in range(rng.randint(3, 30))] for k in range(3)]
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    return inputs


def _made_up_lengths(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(query_start_loc, seq_lens) of batches no engine here schedules: dozens of requests,
    sequences of a million tokens, chunks of any size."""
    cases = []
    for num_reqs in (1, rng.randint(20, 40)):
        query_lens = [1 if rng.random() < 0.5 else rng.randint(2, 5000) for _ in range(num_reqs)]
        context_lens = [rng.choice([0, rng.randint(1, 1_000_000)]) for _ in range(num_reqs)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        cases.append((starts, [c + q for c, q in zip(context_lens, query_lens)]))
    return cases


@exercise("05: query_lens and context_lens from the metadata")
def check_lengths(fn: Callable[[list[int], list[int]], Any]) -> CheckResult:
    """Call `fn(query_start_loc, seq_lens)` (plain lists) on the steps of a small engine run and
    on batches the checker makes up; it must return `(query_lens, context_lens)`, one entry per
    request each."""
    own = package_answer(fn, _LENGTHS_PACKAGE, "the lengths")
    if own is not None:
        return own
    rng = random.Random()
    cases = _engine_lengths(rng) + _made_up_lengths(rng)
    results, rejected = call_on_cases(
        fn, cases, _LENGTHS_PACKAGE, "the lengths", lambda case: f"fn({case[0]}, {case[1]})"[:120]
    )
    if rejected is not None:
        return rejected
    # Every call has returned: only now are the lengths worked out.
    hints = {
        "query_lens": "request i's query tokens are rows query_start_loc[i] ... query_start_loc[i + 1] - 1, "
        "so a decode has 1",
        "context_lens": "the tokens already in the KV cache before this step: the sequence without this step's "
        "query tokens",
    }
    for (starts, seq_lens), got in zip(cases, results):
        where = (
            f"For query_start_loc {starts} and seq_lens {seq_lens}"
            if len(seq_lens) <= 4
            else f"For a batch of {len(seq_lens)} requests"
        )
        try:  # plain lists of ints: an answer's own == (or __iter__) takes no part in the comparison
            mine_q, mine_c = plain(got, ([0], [0]))
        except TypeError as error:
            return CheckResult(
                False, f"{where}: {error}; return a pair (query_lens, context_lens), each a list of ints."
            )
        query_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
        context_lens = [s - q for s, q in zip(seq_lens, query_lens)]
        for name, mine, right in (("query_lens", mine_q, query_lens), ("context_lens", mine_c, context_lens)):
            result = compare(name, mine, right, hints[name])
            if not result:
                wrong = next((i for i, r in enumerate(right) if i >= len(mine) or mine[i] != r), 0)
                return CheckResult(
                    False,
                    f"{where}: {result.message}",
                    reveal=functools.partial(_worked_lengths, starts, seq_lens, wrong),
                )
    return CheckResult(
        True,
        f"query_lens and context_lens right in all {len(cases)} batches "
        f"({len(cases) - 2} engine steps, 2 made-up batches of up to a million tokens).",
    )


def _worked_lengths(starts: list[int], seq_lens: list[int], wrong: int) -> str:
    """query_lens and context_lens of one batch, request by request (the first 4, and the first wrong one)."""
    lines = [
        f"query_start_loc = {starts[:5]}{' ...' if len(starts) > 5 else ''}",
        f"seq_lens = {seq_lens[:4]}{' ...' if len(seq_lens) > 4 else ''}",
    ]
    for i in sorted({*range(min(4, len(seq_lens))), wrong}):
        query_len = starts[i + 1] - starts[i]
        lines.append(
            f"  request {i}: query_len = query_start_loc[{i + 1}] - query_start_loc[{i}] = {starts[i + 1]} - "
            f"{starts[i]} = {query_len}; context_len = seq_len - query_len = {seq_lens[i]} - {query_len} = "
            f"{seq_lens[i] - query_len}"
        )
    return "\n".join(lines)


def _schedule(prompt_len: int, budget: int, max_tokens: int) -> list[int]:
    """The context_len of every step of one request served alone: prompt chunks of `budget`
    tokens, then one token per step (the last sampled token is never run)."""
    context_lens, computed = [], 0
    while computed < prompt_len + max_tokens - 1:
        context_lens.append(computed)
        computed += min(budget, prompt_len - computed) if computed < prompt_len else 1
    return context_lens


def _engine_rows(block_size: int, prompt_len: int, budget: int, max_tokens: int) -> list[tuple[int, list[int]]]:
    """(context_len, sliding-window row) of every step of one greedy request on "tiny-hybrid"."""
    llm = LLM(
        "tiny-hybrid",
        block_size=block_size,
        num_kv_blocks=64,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    groups = llm.runner.kv_cache_config.kv_cache_groups
    group = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec))
    rows: list[tuple[int, list[int]]] = []

    def record(event: StepEvent) -> None:
        batch = event.result.batch
        query_len = batch.query_start_loc_cpu[1] - batch.query_start_loc_cpu[0]
        rows.append((int(batch.seq_lens_cpu[0] - query_len), list(event.block_ids[batch.req_ids[0]][group])))

    llm.add_step_listener(record)
    prompt = [(3 * i + 1) % 250 for i in range(prompt_len)]
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    return rows


def _manager_rows(
    window: int, block_size: int, prompt_len: int, budget: int, max_tokens: int
) -> list[tuple[int, list[int]]]:
    """The rows of `_engine_rows` for any window: the same schedule played on a KV cache manager
    with one sliding-window group, without a model ("tiny-hybrid" has only the window 32)."""
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window
    )
    manager = KVCacheManager(
        KVCacheConfig(spec.blocks_needed(prompt_len + max_tokens) + 1, [KVCacheGroupSpec(["window_layer"], spec)])
    )
    rows = []
    schedule = _schedule(prompt_len, budget, max_tokens)
    for context_len, after in zip(schedule, schedule[1:] + [prompt_len + max_tokens - 1]):
        assert manager.allocate_slots("0", context_len, after - context_len)
        rows.append((context_len, list(manager.get_block_ids("0")[0])))
    return rows


@exercise("05: null blocks of a sliding-window row")
def check_null_blocks(fn: Callable[[int, int, int], Any]) -> CheckResult:
    """Compare `fn(context_len, sliding_window, block_size)` with the leading null blocks of real rows.

    The rows: "tiny-hybrid" (window 32) serving a long request with block sizes 4 and 8 (as the
    notebook says) and one drawn at random; a KV cache manager alone playing the same schedule with
    a window drawn at random; and sequences far longer than any cache here, with windows of real
    models and odd block sizes (no manager can hold those rows; the checker works them out).
    Every call of `fn` comes first; the engine and the manager run afterwards.
    """
    own = package_answer(fn, _WINDOW_PACKAGE, "the count")
    if own is not None:
        return own
    rng = random.Random()
    budget, max_tokens = 16, 16
    engine_runs = [(4, 40), (8, 40), (rng.choice([2, 3, 5, 6, 16]), rng.randint(33, 70))]
    other = (rng.choice([8, 12, 20, 48]), rng.choice([2, 4, 5, 8]), rng.randint(40, 80))
    huge = [
        (rng.randint(10**6, 10**12), window, block)
        for window in (4096, 131072, rng.randint(33, 9999))
        for block in (16, rng.choice([3, 7, 13]))
    ]
    cases = [
        (c, 32, b, f"'tiny-hybrid' (block size {b}, prompt of {n} tokens)")
        for b, n in engine_runs
        for c in _schedule(n, budget, max_tokens)
    ]
    cases += [
        (c, other[0], other[1], f"a KV cache manager (window {other[0]}, block size {other[1]})")
        for c in _schedule(other[2], budget, max_tokens)
    ]
    cases += [(c, w, b, "a made-up sequence") for c, w, b in huge]
    results, rejected = call_on_cases(
        fn,
        [case[:3] for case in cases],
        _WINDOW_PACKAGE,
        "the count",
        lambda case: f"fn({case[0]}, {case[1]}, {case[2]})",
    )
    if rejected is not None:
        return rejected
    # Every call has returned: only now do the engine and the manager make the real rows.
    rows = [row for b, n in engine_runs for row in _engine_rows(b, n, budget, max_tokens)]
    rows += _manager_rows(*other, budget, max_tokens)
    if [r[0] for r in rows] != [c[0] for c in cases[: len(rows)]]:
        raise RuntimeError("The engine's schedule is not the one the checker planned (context_lens differ).")
    for (context_len, window, block, where), got, row in zip(cases, results, [r for _, r in rows] + [None] * len(huge)):
        right = (
            next((i for i, b in enumerate(row) if b != 0), len(row))
            if row is not None
            else max(context_len - window + 1, 0) // block
        )
        try:
            got = plain(got, 0)  # a plain int: an answer's own == takes no part in the comparison
        except TypeError as error:
            return CheckResult(False, f"In {where}, a step with context_len {context_len}: {error}.")
        if got != right:
            return CheckResult(
                False,
                f"In {where}, a step with context_len {context_len}: your function says {got!r} null "
                f"block(s), which is not it. Hint: the step's earliest query sits at position context_len and "
                f"still sees the last sliding_window positions up to its own; a block can be given back only "
                "when all its positions are older than that, and there is never a negative number of blocks.",
                reveal=functools.partial(_worked_null_blocks, context_len, window, block),
            )
    return CheckResult(
        True,
        f"Your function matches all {len(cases)} rows: window 32 with block sizes "
        f"{[b for b, _ in engine_runs]}, window {other[0]} with block size {other[1]}, and "
        f"{len(huge)} sequences of up to 10^12 tokens.",
    )


def _worked_null_blocks(context_len: int, window: int, block_size: int) -> str:
    """The null-block count of one step, step by step."""
    oldest = max(context_len - window + 1, 0)
    return "\n".join(
        [
            f"context_len = {context_len}, sliding_window = {window}, block_size = {block_size}",
            f"  the earliest query of the step sits at position context_len = {context_len}",
            f"  it sees positions p with {context_len} - p < {window}: the oldest it sees is "
            f"max({context_len} - {window} + 1, 0) = {oldest}",
            f"  blocks 0 ... j hold positions up to (j + 1) * {block_size} - 1; those wholly before position {oldest} "
            f"are {oldest} // {block_size} = {oldest // block_size} block(s)",
            f"  num_null_blocks = max(context_len - sliding_window + 1, 0) // block_size = {oldest // block_size}",
        ]
    )
