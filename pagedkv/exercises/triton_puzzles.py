"""Checkers for notebook 06's Triton puzzle ladder, from one block-table row to split-KV attention.

Every puzzle uses the same paged layout, with small random inputs chosen here; the first case of
each has pages of 4 keys and heads of 16 values, the others other powers of two (a launcher must
read the sizes from the tensors):

    block_table [num_reqs, max_pages] int32   request r's key position p lives in physical block
                                              block_table[r, p // page_size], row p % page_size;
                                              entries past a request's last page are 0 (the null block)
    seq_lens    [num_reqs] int32              keys per request (the last page may be partial)
    k_cache, v_cache                          [num_blocks, page_size, head_size] (one KV head), or
                                              [num_blocks, page_size, num_kv_heads, head_size] (puzzle 6)

The harness (`check_launches`: a `@triton.jit` kernel required, pagedkv's own refused, the launcher
watched so that it cannot compute the answer in torch, the reference computed afterwards) lives in
`pagedkv.exercises.kernels`, with puzzle 2 (the scatter). Each checker below works out its float64
reference in nested code, only after the launcher has run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedkv.exercises import CheckResult, exercise
from pagedkv.exercises.kernels import Case, Launch, check_launches, check_scatter_kernel, unwritten
from pagedkv.platforms import default_device

__all__ = [
    "check_block_table_row",
    "check_scatter_kernel",
    "check_page_scores",
    "check_masked_scores",
    "check_online_softmax",
    "check_gqa_attention",
    "check_split_kv",
]

SMALL = (4, 16)  # (page_size, head_size) of each puzzle's first case, as in the notebook's picture
LARGER = (8, 32)
TINY = (2, 8)


def _paged_inputs(
    gen: torch.Generator, seq_lens: list[int], max_pages: int, sizes: tuple[int, int], num_kv_heads: int = 0
) -> dict[str, torch.Tensor]:
    """A random block table (pages permuted, unused entries 0) and random K/V caches with
    `sizes = (page_size, head_size)`; block 0 holds random values too, so reading an unused entry
    gives a finite, wrong number. `num_kv_heads=0` drops the heads dimension (one KV head)."""
    page_size, head_size = sizes
    pages = [-(-n // page_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    for r, n in enumerate(pages):
        block_table[r, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    heads = (num_kv_heads,) if num_kv_heads else ()
    shape = (num_blocks, page_size, *heads, head_size)
    return {
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "k_cache": torch.randn(shape, generator=gen),
        "v_cache": torch.randn(shape, generator=gen),
    }


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies for the launcher (the checker keeps the originals: a kernel that writes into its
    inputs cannot change the reference)."""
    device = default_device()  # compiled Triton needs GPU tensors; the interpreter takes CPU ones
    return [t.to(device, copy=True) for t in tensors]


def _describe(inputs: dict[str, Any]) -> str:
    table = inputs["block_table"].tolist()
    page_size, head_size = inputs["k_cache"].shape[1], inputs["k_cache"].shape[-1]
    return f"seq_lens {inputs['seq_lens'].tolist()}, page size {page_size}, head size {head_size}, block_table {table}"


def _memory_rules(table: torch.Tensor, seq_lens: list[int], caches: dict[str, torch.Size], out: str) -> dict[str, Any]:
    """The memory rules of an attention puzzle: program (r, ...) loads only the cache rows that hold
    request r's keys, and every row `out[r]` of the output is written."""
    blocks_and_rows = tuple(next(iter(caches.values()))[:2])  # [num_blocks, page_size] of every cache
    page_size = blocks_and_rows[1]
    owned = {}
    for r, n in enumerate(seq_lens):
        rows = np.zeros(blocks_and_rows, dtype=bool)
        for p in range(n):
            rows[int(table[r, p // page_size]), p % page_size] = True
        owned[r] = rows

    def allowed(shape: torch.Size) -> Callable[[tuple[int, int, int]], np.ndarray]:
        return lambda program: np.broadcast_to(owned[program[0]].reshape(*shape[:2], *[1] * (len(shape) - 2)), shape)

    return {
        "rows_written": {out: 1},
        "allowed": {name: allowed(shape) for name, shape in caches.items()},
        "reasons": {
            name: "that holds no key of the program's request (mask the loads past seq_len)" for name in caches
        },
    }


def _numbers(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values.tolist()) + "]"


@exercise("06: puzzle 1, load one block-table row")
def check_block_table_row(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 1: `launch(kernel, block_table, seq_lens, slots, page_size)`; slots[r, p] is
    block_table[r, p // page_size] * page_size + p % page_size for p < seq_lens[r], else -1."""

    def case(seed: int, seq_lens: list[int], sizes: tuple[int, int]) -> Case:
        inputs = _paged_inputs(torch.Generator().manual_seed(seed), seq_lens, max_pages=4, sizes=sizes)
        table, page_size = inputs["block_table"], sizes[0]
        width = 4 * page_size
        block_table, seq_lens_t, slots = _on_device(
            table, inputs["seq_lens"], torch.full((len(seq_lens), width), -2, dtype=torch.int32)
        )

        def slot_of(r: int, p: int) -> int:
            return int(table[r, p // page_size]) * page_size + p % page_size if p < seq_lens[r] else -1

        def reference() -> dict[str, torch.Tensor]:
            return {
                "slots": torch.tensor(
                    [[slot_of(r, p) for p in range(width)] for r in range(len(seq_lens))], dtype=torch.int32
                )
            }

        def explain(name: str, index: tuple[int, ...], got: float, expected: Any) -> tuple[str, Any]:
            r, p = index
            n, j, offset = seq_lens[r], p // page_size, p % page_size
            block = int(table[r, j])
            if p >= n:
                shows = f" (position {p} is past seq_len {n}: it gets -1)"
            elif got == -1:
                shows = f" (position {p} < seq_len {n} is a key of the request: it gets a slot, not -1)"
            elif got == p:
                shows = " (that is the logical position: look up the physical block in the block-table row)"
            elif got == block * page_size:
                shows = " (that is the first slot of the block: add the offset in the page)"
            elif got == block:
                shows = " (that is the physical block: a slot is block * page_size + offset)"
            else:
                shows = unwritten(got, -2)

            def work() -> str:
                if p >= n:
                    return f"request {r}, position {p}: seq_len is {n}, so slots[{r}, {p}] = -1."
                return (
                    f"request {r}, position {p}: page {p} // {page_size} = {j}, block_table[{r}, {j}] = {block}, "
                    f"offset {p} % {page_size} = {offset}; slot = {block} * {page_size} + {offset} = "
                    f"{slot_of(r, p)}."
                )

            return shows, work

        return Case(
            [block_table, seq_lens_t, slots, page_size],
            {"slots": slots},
            _describe(inputs),
            reference,
            explain,
            inputs={"block_table": block_table, "seq_lens": seq_lens_t},
            access={"rows_written": {"slots": 1}},
        )

    cases = [lambda: case(0, [5, 16, 1], SMALL), lambda: case(1, [9, 30], LARGER)]
    hint = "one program per request: load its block-table row at positions // page_size (masked past seq_len)."
    return check_launches([kernel], launch, cases, "block-table row", hint)


def _check_scores(
    kernel: Any, launch: Launch, specs: list[tuple[int, list[int], int, tuple[int, int]]], what: str, hint: str
) -> CheckResult:
    """Puzzles 3 and 4: `launch(kernel, q, k_cache, block_table, seq_lens, scores, scale)` on the
    cases `specs` = (seed, seq_lens, max_pages, sizes)."""

    def case(seed: int, seq_lens: list[int], max_pages: int, sizes: tuple[int, int]) -> Case:
        gen = torch.Generator().manual_seed(seed)
        inputs = _paged_inputs(gen, seq_lens, max_pages, sizes)
        page_size, head_size = sizes
        q = torch.randn(len(seq_lens), head_size, generator=gen)
        table, k_cache, scale = inputs["block_table"], inputs["k_cache"], head_size**-0.5
        width = max_pages * page_size
        args = _on_device(q, k_cache, table, inputs["seq_lens"], torch.full((len(seq_lens), width), float("nan")))

        def dot(r: int, p: int) -> float:
            """q[r] . key p of request r, unscaled."""
            return float(k_cache[int(table[r, p // page_size]), p % page_size].double() @ q[r].double())

        def reference() -> dict[str, torch.Tensor]:
            scores = torch.full((len(seq_lens), width), float("-inf"), dtype=torch.float64)
            for r, n in enumerate(seq_lens):
                for p in range(n):
                    scores[r, p] = dot(r, p) * scale
            return {"scores": scores}

        def explain(name: str, index: tuple[int, ...], got: float, expected: Any) -> tuple[str, Any]:
            r, p = index
            n, j, row = seq_lens[r], p // page_size, p % page_size
            block = int(table[r, j])
            if p >= n:
                shows = f" (position {p} is past seq_len {n}: it must score -inf)"
            elif got == float("-inf"):
                shows = f" (position {p} < seq_len {n} is a key of the request: do not mask it)"
            elif abs(got - dot(r, p)) < 1e-4:
                shows = " (that is q . k without the scale)"
            else:
                shows = unwritten(got, float("nan"))

            def work() -> str:
                if p >= n:
                    return f"request {r}, position {p}: seq_len is {n}, so scores[{r}, {p}] = -inf."
                return (
                    f"request {r}, position {p}: page {j}, row {row}; block = block_table[{r}, {j}] = {block}; "
                    f"q[{r}] . k_cache[{block}, {row}] = {dot(r, p):.4f}; times scale {scale:.4f} "
                    f"= {dot(r, p) * scale:.4f}."
                )

            return shows, work

        return Case(
            [*args[:5], scale],
            {"scores": args[4]},
            _describe(inputs),
            reference,
            explain,
            inputs=dict(zip(("q", "k_cache", "block_table", "seq_lens"), args)),
            access=_memory_rules(table, seq_lens, {"k_cache": k_cache.shape}, "scores"),
        )

    return check_launches([kernel], launch, [functools.partial(case, *spec) for spec in specs], what, hint)


@exercise("06: puzzle 3, Q.K^T over one page")
def check_page_scores(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 3: `launch(kernel, q, k_cache, block_table, seq_lens, scores, scale)`, every page
    full: scores[r, j * page_size + i] = q[r] . k_cache[block_table[r, j], i] * scale."""
    hint = "program (r, j): block = block_table[r, j]; a [page_size, head_size] K tile; sum(q * k, axis=1) * scale."
    return _check_scores(
        kernel, launch, [(2, [8, 8, 8], 2, SMALL), (3, [16, 16], 2, LARGER)], "Q.K^T over one page", hint
    )


@exercise("06: puzzle 4, masking the last partial page")
def check_masked_scores(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 4: puzzle 3 with partial last pages and unused block-table entries: scores past
    seq_lens[r] are -inf (what softmax turns into weight 0)."""
    hint = "positions j * page_size + i >= seq_len get -inf (tl.where); mask the loads of pages past the end."
    return _check_scores(kernel, launch, [(4, [5, 16, 1], 4, SMALL), (5, [13, 2], 3, LARGER)], "masked scores", hint)


def _check_attention(
    kernels: list[Any], launch: Launch, specs: list[dict[str, Any]], what: str, hint: str
) -> CheckResult:
    """Puzzles 5-7: decode attention, `launch(*kernels, q, k_cache, v_cache, block_table, seq_lens,
    out, scale[, num_splits])` on the cases `specs` (keyword arguments of `case` below). Without
    heads, q and out are [R, D] and the caches have no heads dimension (one KV head)."""

    def case(
        seed: int,
        seq_lens: list[int],
        sizes: tuple[int, int],
        num_q_heads: int = 0,
        num_kv_heads: int = 0,
        num_splits: int = 0,
    ) -> Case:
        gen = torch.Generator().manual_seed(seed)
        page_size, head_size = sizes
        max_pages = -(-max(seq_lens) // page_size) + 1
        inputs = _paged_inputs(gen, seq_lens, max_pages, sizes, num_kv_heads=num_kv_heads or 1)
        q = torch.randn(len(seq_lens), num_q_heads or 1, head_size, generator=gen)
        table, scale = inputs["block_table"], head_size**-0.5
        group = q.shape[1] // inputs["k_cache"].shape[2]
        shown = {"q": q, "k_cache": inputs["k_cache"], "v_cache": inputs["v_cache"]}
        if not num_kv_heads:  # drop the heads dimension the launcher sees
            shown = {"q": q[:, 0], "k_cache": inputs["k_cache"][:, :, 0], "v_cache": inputs["v_cache"][:, :, 0]}
        out_shape = shown["q"].shape
        args = _on_device(
            shown["q"],
            shown["k_cache"],
            shown["v_cache"],
            table,
            inputs["seq_lens"],
            torch.full(out_shape, float("nan")),
        )

        def keys(cache: torch.Tensor, r: int, kv: int) -> torch.Tensor:
            """Request r's keys (or values) of KV head kv, in position order, float64 [n, D]."""
            pages = table[r, : -(-seq_lens[r] // page_size)].long()
            return cache[pages][:, :, kv].flatten(0, 1)[: seq_lens[r]].double()

        def scores(r: int, h: int) -> torch.Tensor:
            return keys(inputs["k_cache"], r, h // group) @ q[r, h].double() * scale

        def reference() -> dict[str, torch.Tensor]:
            out = torch.empty(q.shape, dtype=torch.float64)
            for r in range(len(seq_lens)):
                for h in range(q.shape[1]):
                    out[r, h] = torch.softmax(scores(r, h), 0) @ keys(inputs["v_cache"], r, h // group)
            return {"out": out if num_kv_heads else out[:, 0]}

        def explain(name: str, index: tuple[int, ...], got: float, expected: Any) -> tuple[str, Any]:
            r, h, d = index if num_kv_heads else (index[0], 0, index[1])
            empty = "; a split with no pages has l = 0" if num_splits else ""
            shows = f" (never written, or a 0 / 0 or -inf - (-inf) on the way{empty})" if got != got else ""
            wrong_kv = h % inputs["k_cache"].shape[2]  # the usual mix-up: KV head h % num_kv_heads
            if num_kv_heads and wrong_kv != h // group:
                s_wrong = keys(inputs["k_cache"], r, wrong_kv) @ q[r, h].double() * scale
                if abs(float(torch.softmax(s_wrong, 0) @ keys(inputs["v_cache"], r, wrong_kv)[:, d]) - got) < 1e-4:
                    shows = (
                        f" (that is query head {h} attending to KV head {h} % {num_kv_heads} = {wrong_kv}: "
                        f"query head h reads KV head h // G)"
                    )

            def work() -> str:
                n, s = seq_lens[r], scores(r, h)
                pages = -(-n // page_size)
                v = keys(inputs["v_cache"], r, h // group)[:, d]
                w = torch.softmax(s, 0)
                head = f", query head {h} reads KV head {h} // {group} = {h // group}" if num_kv_heads else ""
                lines = [
                    f"request {r}{head}: seq_len {n}, pages 0..{pages - 1} in blocks "
                    f"{table[r, :pages].tolist()} (block_table row {r}).",
                    f"scores q . k * {scale:.4f} of its {n} keys: {_numbers(s)}",
                    f"softmax weights exp(s - {float(s.max()):.3g}) / their sum: {_numbers(w)}",
                    f"v[:, {d}] of those keys: {_numbers(v)}",
                ]
                if num_splits:
                    per_split = -(-pages // num_splits)
                    for split in range(num_splits):
                        first, end = split * per_split, min((split + 1) * per_split, pages)
                        part = s[first * page_size : end * page_size]
                        lse = f"{float(torch.logsumexp(part, 0)):.4g}" if part.numel() else "-inf (empty: weight 0)"
                        lines.append(f"split {split}: pages {first}..{end - 1}, lse_{split} = {lse}")
                lines.append(f"{name}[{', '.join(map(str, index))}] = sum of weight * v = {float(w @ v):.4g}")
                return "\n".join(lines)

            return shows, work

        extra = [num_splits] if num_splits else []
        description = _describe(inputs) + (f", {num_splits} splits" if num_splits else "")
        caches = {"k_cache": shown["k_cache"].shape, "v_cache": shown["v_cache"].shape}
        return Case(
            [*args, scale, *extra],
            {"out": args[5]},
            description,
            reference,
            explain,
            inputs=dict(zip(("q", "k_cache", "v_cache", "block_table", "seq_lens"), args)),
            access=_memory_rules(table, seq_lens, caches, "out"),
        )

    return check_launches(kernels, launch, [functools.partial(case, **spec) for spec in specs], what, hint)


@exercise("06: puzzle 5, online softmax across pages")
def check_online_softmax(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 5: `launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale)`:
    out[r] = softmax(q[r] . K_r * scale) @ V_r over the request's seq_len keys, page by page."""
    specs = [dict(seed=6, seq_lens=[5, 17, 1], sizes=SMALL), dict(seed=7, seq_lens=[20, 3], sizes=LARGER)]
    hint = (
        "keep m (running max), l (running sum) and acc; per page: m_new = max(m, max(s)), "
        "alpha = exp(m - m_new), l = l * alpha + sum(p), acc = acc * alpha + p @ v; out = acc / l."
    )
    return _check_attention([kernel], launch, specs, "online softmax", hint)


@exercise("06: puzzle 6, GQA packing")
def check_gqa_attention(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 6: puzzle 5 with heads: q, out [R, num_q_heads, D], caches [blocks, page, num_kv_heads, D];
    one program per (request, KV head) computes its G = num_q_heads // num_kv_heads query heads."""
    # G = 2 = num_kv_heads, then G = 4 != 2 (a kernel that mixes them up passes the first), then MQA.
    specs = [
        dict(seed=8, seq_lens=[5, 17, 1], sizes=SMALL, num_q_heads=4, num_kv_heads=2),
        dict(seed=12, seq_lens=[9, 3], sizes=LARGER, num_q_heads=8, num_kv_heads=2),
        dict(seed=9, seq_lens=[11], sizes=TINY, num_q_heads=4, num_kv_heads=1),
    ]
    hint = "query head h reads KV head h // G: program (r, kv) loads q rows kv * G ... kv * G + G - 1 as a [G, D] tile."
    return _check_attention([kernel], launch, specs, "GQA attention", hint)


@exercise("06: puzzle 7, split-KV with a log-sum-exp merge")
def check_split_kv(kernels: tuple[Any, Any], launch: Launch) -> CheckResult:
    """Puzzle 7: `launch(partial_kernel, merge_kernel, q, k_cache, v_cache, block_table, seq_lens,
    out, scale, num_splits)`: each split attends to its share of the pages and writes its output
    and log-sum-exp; the merge mixes them. Some splits are empty (short sequences)."""
    if not isinstance(kernels, tuple) or len(kernels) != 2:
        return CheckResult(False, "split-KV: pass the two kernels as a tuple (partial_kernel, merge_kernel).")
    specs = [
        dict(seed=10, seq_lens=[5, 19, 1], sizes=SMALL, num_splits=3),
        dict(seed=11, seq_lens=[20, 2], sizes=LARGER, num_splits=2),
    ]
    hint = (
        "merge: lse = log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) * o_s; "
        "an empty split has lse_s = -inf and must not make NaN."
    )
    return _check_attention(list(kernels), launch, specs, "split-KV", hint)
