"""Checkers for notebook 05 (attention groups and metadata): step lengths and sliding-window rows."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.events import StepEvent
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.exercises import CheckResult, compare
from pagedkv.kv_cache.manager import KVCacheManager
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec


def step_lengths(event: StepEvent) -> dict[str, list[int]]:
    """context_lens, query_lens and seq_lens of a recorded step, per request in batch order.

    Read off the step's CommonAttentionMetadata (the lengths are the same in every KV cache group).
    """
    common = event.runner.common_attn_metadata(event.result.batch, kv_group=0)
    return {
        "context_lens": common.context_lens_cpu.tolist(),
        "query_lens": common.query_lens_cpu.tolist(),
        "seq_lens": common.seq_lens_cpu.tolist(),
    }


def check_lengths(event: StepEvent, *, query_lens: Any, context_lens: Any) -> CheckResult:
    """Compare the student's per-request query_lens and context_lens with the recorded step."""
    expected = step_lengths(event)
    hints = {
        "query_lens": "request i's query tokens are rows query_start_loc[i] ... query_start_loc[i + 1] - 1 "
                      "(1 for a decode)",
        "context_lens": "tokens already in the KV cache before this step: seq_len - query_len",
    }
    for name, got in (("query_lens", query_lens), ("context_lens", context_lens)):
        if hasattr(got, "tolist"):  # a torch tensor or a numpy array of the right values is right too
            got = got.tolist()
        got_list = list(got) if isinstance(got, Sequence) and not isinstance(got, str) else got
        result = compare(name, got_list, expected[name], hints[name])
        if not result:
            return result
    return CheckResult(True, f"query_lens {expected['query_lens']} and context_lens {expected['context_lens']} "
                             "match the step's metadata.")


def sliding_window_group(llm: LLM) -> int:
    """Index of the (first) KV cache group whose layers use a sliding window."""
    for i, group in enumerate(llm.runner.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, SlidingWindowSpec):
            return i
    raise ValueError("This engine has no sliding-window KV cache group; use a model such as 'tiny-hybrid'.")


@dataclass
class SlidingRowSample:
    """One request in one step: its context length and its sliding-window block table row."""

    step: int
    request_id: str
    context_len: int
    row: list[int]
    sliding_window: int
    block_size: int

    @property
    def null_blocks(self) -> int:
        """How many leading entries of the row are the null block 0."""
        return next((i for i, b in enumerate(self.row) if b != 0), len(self.row))


def sliding_window_rows(block_size: int, prompt_len: int = 40, max_tokens: int = 16) -> list[SlidingRowSample]:
    """Serve one greedy request on "tiny-hybrid" and collect its sliding-window row in every step."""
    llm = LLM("tiny-hybrid", block_size=block_size, num_kv_blocks=64, max_num_batched_tokens=16)
    group = sliding_window_group(llm)
    spec = llm.runner.kv_cache_config.kv_cache_groups[group].kv_cache_spec
    assert isinstance(spec, SlidingWindowSpec)
    samples: list[SlidingRowSample] = []

    def record(event: StepEvent) -> None:
        lengths = step_lengths(event)
        for rid, ctx in zip(event.result.batch.req_ids, lengths["context_lens"]):
            samples.append(SlidingRowSample(event.step, rid, ctx, event.block_ids[rid][group],
                                            spec.sliding_window, spec.block_size))

    llm.add_step_listener(record)
    prompt = [(3 * i + 1) % 250 for i in range(prompt_len)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                               ignore_eos=True))
    return samples


def manager_window_rows(
    sliding_window: int, block_size: int, prompt_len: int, budget: int = 16, max_tokens: int = 16
) -> list[SlidingRowSample]:
    """The rows of `sliding_window_rows` for any window: the same schedule (prompt chunks of
    `budget` tokens, then one token per step) played on a KV cache manager with one
    sliding-window group, without a model ("tiny-hybrid" has only the window 32)."""
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=sliding_window)
    num_blocks = spec.blocks_needed(prompt_len + max_tokens) + 1
    manager = KVCacheManager(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["window_layer"], spec)]))
    samples: list[SlidingRowSample] = []
    computed, step = 0, 1
    while computed < prompt_len + max_tokens - 1:  # the last sampled token is never run
        new = min(budget, prompt_len - computed) if computed < prompt_len else 1
        assert manager.allocate_slots("0", computed, new)
        samples.append(SlidingRowSample(step, "0", computed, manager.get_block_ids("0")[0], sliding_window,
                                        block_size))
        computed, step = computed + new, step + 1
    return samples


def check_null_blocks(fn: Callable[[int, int, int], Any]) -> CheckResult:
    """Compare `fn(context_len, sliding_window, block_size)` with the null blocks of real rows.

    The engine serves a long request on "tiny-hybrid" (window 32) with block sizes 4 and 8 (as the
    notebook says), then once more with a block size and a prompt length drawn at random on each
    call; a KV cache manager then plays the same schedule with a random other window. In every
    step the number of leading null blocks in the request's sliding-window row must equal fn(...).
    """
    if not callable(fn):
        return CheckResult(False, f"Pass your function itself, got {fn!r}.")
    checked = 0
    rng = random.Random()
    runs = [(4, 40), (8, 40), (rng.choice([2, 3, 5, 6, 16]), rng.randint(33, 70))]
    other = (rng.choice([8, 12, 20, 48]), rng.choice([2, 4, 5, 8]), rng.randint(40, 80))
    runs_rows = [sliding_window_rows(b, n) for b, n in runs] + [manager_window_rows(*other)]
    for rows in runs_rows:
        for s in rows:
            try:
                got = fn(s.context_len, s.sliding_window, s.block_size)
            except Exception as exc:  # noqa: BLE001  (the student's code may raise anything)
                return CheckResult(False, f"fn({s.context_len}, {s.sliding_window}, {s.block_size}) raised "
                                          f"{type(exc).__name__}: {exc}.")
            checked += 1
            if got != s.null_blocks:
                first_query = s.context_len
                oldest_key = max(first_query - s.sliding_window + 1, 0)
                return CheckResult(
                    False,
                    f"In step {s.step} (context_len {s.context_len}, window {s.sliding_window}, block size "
                    f"{s.block_size}) the engine's row starts {s.row[: s.null_blocks + 2]}...: "
                    f"{s.null_blocks} null block(s), your function says {got!r}. Hint: the earliest query of "
                    f"the step is at position {first_query}; it still sees keys down to position "
                    f"max({first_query} - {s.sliding_window} + 1, 0) = {oldest_key}, and only blocks that end "
                    "before that position can be given back.",
                )
    return CheckResult(True, f"Your function matches the engine's sliding-window rows in all {checked} "
                             f"(step, block size) cases: window 32 with block sizes {[b for b, _ in runs]}, "
                             f"window {other[0]} with block size {other[1]}.")
