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

The harness (`check_launches`: a `@triton.jit` kernel required, pagedkv's own refused, launches
counted, first mismatch named) lives in `pagedkv.exercises.kernels`, with puzzle 2 (the scatter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.exercises import CheckResult
from pagedkv.exercises.kernels import Case, Launch, check_launches, check_scatter_kernel
from pagedkv.platforms import default_device

__all__ = [
    "check_block_table_row", "check_scatter_kernel", "check_page_scores", "check_masked_scores",
    "check_online_softmax", "check_gqa_attention", "check_split_kv",
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


def _keys_of(cache: torch.Tensor, block_table: torch.Tensor, r: int, seq_len: int) -> torch.Tensor:
    """Request r's first `seq_len` keys (or values) in position order, in float64."""
    pages = block_table[r, : -(-seq_len // cache.shape[1])].long()
    return cache[pages].flatten(0, 1)[:seq_len].double()


def _scale(q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5


def _scores_ref(q: torch.Tensor, inputs: dict[str, Any], width: int) -> torch.Tensor:
    """scores[r, p] = q[r] . key p of request r / sqrt(head_size); -inf past seq_lens[r]."""
    scores = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float64)
    for r, n in enumerate(inputs["seq_lens"].tolist()):
        scores[r, :n] = _keys_of(inputs["k_cache"], inputs["block_table"], r, n) @ q[r].double() * _scale(q)
    return scores


def _attention_ref(q: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """Decode attention in float64. q [R, Hq, D], caches with heads; query head h reads KV head
    h // (Hq // Hkv)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // inputs["k_cache"].shape[2]
    for r, n in enumerate(inputs["seq_lens"].tolist()):
        k = _keys_of(inputs["k_cache"], inputs["block_table"], r, n).repeat_interleave(group, dim=1)
        v = _keys_of(inputs["v_cache"], inputs["block_table"], r, n).repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[r].double(), k) * _scale(q), dim=-1)
        out[r] = torch.einsum("hk,khd->hd", p, v)
    return out


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    device = default_device()  # compiled Triton needs GPU tensors; the interpreter takes CPU ones
    return [t.to(device) for t in tensors]


def _describe(inputs: dict[str, Any]) -> str:
    table = inputs["block_table"].tolist()
    page_size, head_size = inputs["k_cache"].shape[1], inputs["k_cache"].shape[-1]
    return f"seq_lens {inputs['seq_lens'].tolist()}, page size {page_size}, head size {head_size}, block_table {table}"


def _block_table_case(seed: int, seq_lens: list[int], sizes: tuple[int, int]) -> Case:
    inputs = _paged_inputs(torch.Generator().manual_seed(seed), seq_lens, max_pages=4, sizes=sizes)
    page_size = sizes[0]
    width = 4 * page_size
    expected = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        p = torch.arange(n)
        expected[r, :n] = inputs["block_table"][r, p // page_size] * page_size + p % page_size
    block_table, seq_lens_t, slots = _on_device(inputs["block_table"], inputs["seq_lens"],
                                                torch.full_like(expected, -2))
    return Case([block_table, seq_lens_t, slots, page_size], {"slots": slots}, {"slots": expected}, _describe(inputs))


def check_block_table_row(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 1: `launch(kernel, block_table, seq_lens, slots, page_size)`; slots[r, p] is
    block_table[r, p // page_size] * page_size + p % page_size for p < seq_lens[r], else -1."""
    cases = [lambda: _block_table_case(0, [5, 16, 1], SMALL), lambda: _block_table_case(1, [9, 30], LARGER)]
    hint = "one program per request: load its block-table row at positions // page_size (masked past seq_len)."
    return check_launches([kernel], launch, cases, "block-table row", hint)


def _scores_case(seed: int, seq_lens: list[int], max_pages: int, sizes: tuple[int, int]) -> Case:
    gen = torch.Generator().manual_seed(seed)
    inputs = _paged_inputs(gen, seq_lens, max_pages, sizes)
    q = torch.randn(len(seq_lens), sizes[1], generator=gen)
    expected = _scores_ref(q, inputs, max_pages * sizes[0])
    q_d, k_cache, block_table, seq_lens_t, scores = _on_device(
        q, inputs["k_cache"], inputs["block_table"], inputs["seq_lens"], torch.full(expected.shape, float("nan")))
    args = [q_d, k_cache, block_table, seq_lens_t, scores, _scale(q)]
    return Case(args, {"scores": scores}, {"scores": expected}, _describe(inputs))


def check_page_scores(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 3: `launch(kernel, q, k_cache, block_table, seq_lens, scores, scale)`, every page
    full: scores[r, j * page_size + i] = q[r] . k_cache[block_table[r, j], i] * scale."""
    cases = [lambda: _scores_case(2, [8, 8, 8], 2, SMALL), lambda: _scores_case(3, [16, 16], 2, LARGER)]
    hint = "program (r, j): block = block_table[r, j]; a [page_size, head_size] K tile; sum(q * k, axis=1) * scale."
    return check_launches([kernel], launch, cases, "Q.K^T over one page", hint)


def check_masked_scores(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 4: puzzle 3 with partial last pages and unused block-table entries: scores past
    seq_lens[r] are -inf (what softmax turns into weight 0)."""
    cases = [lambda: _scores_case(4, [5, 16, 1], 4, SMALL), lambda: _scores_case(5, [13, 2], 3, LARGER)]
    hint = "positions j * page_size + i >= seq_len get -inf (tl.where); mask the loads of pages past the end."
    return check_launches([kernel], launch, cases, "masked scores", hint)


def _attention_case(seed: int, seq_lens: list[int], sizes: tuple[int, int], num_q_heads: int = 0,
                    num_kv_heads: int = 0, num_splits: int = 0) -> Case:
    """Decode attention inputs; without heads (0) q is [R, D] and the caches have one KV head."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = -(-max(seq_lens) // sizes[0]) + 1
    inputs = _paged_inputs(gen, seq_lens, max_pages, sizes, num_kv_heads=num_kv_heads or 1)
    q = torch.randn(len(seq_lens), num_q_heads or 1, sizes[1], generator=gen)
    expected = _attention_ref(q, inputs)
    if not num_kv_heads:
        q, expected = q[:, 0], expected[:, 0]
        inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"][:, :, 0], inputs["v_cache"][:, :, 0]
    q_d, k_cache, v_cache, block_table, seq_lens_t, out = _on_device(
        q, inputs["k_cache"], inputs["v_cache"], inputs["block_table"], inputs["seq_lens"],
        torch.full(expected.shape, float("nan")))
    args = [q_d, k_cache, v_cache, block_table, seq_lens_t, out, _scale(q)] + ([num_splits] if num_splits else [])
    description = _describe(inputs) + (f", {num_splits} splits" if num_splits else "")
    return Case(args, {"out": out}, {"out": expected}, description)


def check_online_softmax(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 5: `launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale)`:
    out[r] = softmax(q[r] . K_r * scale) @ V_r over the request's seq_len keys, page by page."""
    cases: list[Callable[[], Case]] = [lambda: _attention_case(6, [5, 17, 1], SMALL),
                                       lambda: _attention_case(7, [20, 3], LARGER)]
    hint = ("keep m (running max), l (running sum) and acc; per page: m_new = max(m, max(s)), "
            "alpha = exp(m - m_new), l = l * alpha + sum(p), acc = acc * alpha + p @ v; out = acc / l.")
    return check_launches([kernel], launch, cases, "online softmax", hint)


def check_gqa_attention(kernel: Any, launch: Launch) -> CheckResult:
    """Puzzle 6: puzzle 5 with heads: q, out [R, num_q_heads, D], caches [blocks, page, num_kv_heads, D];
    one program per (request, KV head) computes its G = num_q_heads // num_kv_heads query heads."""
    # G = 2 = num_kv_heads, then G = 4 != 2 (a kernel that mixes them up passes the first), then MQA.
    cases = [lambda: _attention_case(8, [5, 17, 1], SMALL, num_q_heads=4, num_kv_heads=2),
             lambda: _attention_case(12, [9, 3], LARGER, num_q_heads=8, num_kv_heads=2),
             lambda: _attention_case(9, [11], TINY, num_q_heads=4, num_kv_heads=1)]
    hint = "query head h reads KV head h // G: program (r, kv) loads q rows kv * G ... kv * G + G - 1 as a [G, D] tile."
    return check_launches([kernel], launch, cases, "GQA attention", hint)


def check_split_kv(kernels: tuple[Any, Any], launch: Launch) -> CheckResult:
    """Puzzle 7: `launch(partial_kernel, merge_kernel, q, k_cache, v_cache, block_table, seq_lens,
    out, scale, num_splits)`: each split attends to its share of the pages and writes its output
    and log-sum-exp; the merge mixes them. Some splits are empty (short sequences)."""
    if not isinstance(kernels, tuple) or len(kernels) != 2:
        return CheckResult(False, "split-KV: pass the two kernels as a tuple (partial_kernel, merge_kernel).")
    cases = [lambda: _attention_case(10, [5, 19, 1], SMALL, num_splits=3),
             lambda: _attention_case(11, [20, 2], LARGER, num_splits=2)]
    hint = ("merge: lse = log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) * o_s; "
            "an empty split has lse_s = -inf and must not make NaN.")
    return check_launches(list(kernels), launch, cases, "split-KV", hint)
