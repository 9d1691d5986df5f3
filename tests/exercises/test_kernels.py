"""Notebook 06's Triton puzzle checkers: each accepts a right kernel written here, names the first
wrong entry of a wrong one (the rule it broke, never the expected value; `reveal()` after three
tries), and refuses answers that do no kernel work: a plain function, pagedkv's own kernel or
reference, a launcher that computes in torch (on its thread or another), reads values into Python,
writes the outputs itself or copies in a precomputed answer, or a kernel that calls torch."""

from __future__ import annotations

import array
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedkv.exercises.triton_puzzles as P
import pagedkv.kernels as K
from pagedkv.exercises import FAIL_MARK, PASS_MARK, TODO_MARK, CheckResult, reveal
from pagedkv.exercises.kernels import INTERPRETER_OPS
from tests.exercises.checks import assert_rejected, revealed

if not K.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedkv.kernels.reshape_and_cache import _reshape_and_cache_kernel  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_triton_kernels.ipynb"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETED,
    reason="checks what only Triton's interpreter shows (recorded loads and stores, its own torch ops, programs run "
    "in order, host pointers); compiled on a GPU the checker has none of these",
)


# Each kernel takes BUG: a compile-time switch to a typical mistake, so right and wrong share code.
@triton.jit
def _slots(
    bt_ptr,
    seq_lens_ptr,
    slots_ptr,
    stride_bt,
    stride_slots,
    PAGE: tl.constexpr,
    MAX_POS: tl.constexpr,
    BUG: tl.constexpr,
):
    req = tl.program_id(0)
    pos = tl.arange(0, MAX_POS)
    in_seq = pos < tl.load(seq_lens_ptr + req)
    block = tl.load(bt_ptr + req * stride_bt + pos // PAGE, mask=in_seq, other=0)
    slot = block * PAGE if BUG else block * PAGE + pos % PAGE  # BUG: forgets the offset in the page
    tl.store(slots_ptr + req * stride_slots + pos, tl.where(in_seq, slot, -1))


def _launch_slots(bug: bool) -> Callable[..., None]:
    def launch(kernel, block_table, seq_lens, slots, page_size):
        kernel[(block_table.shape[0],)](
            block_table,
            seq_lens,
            slots,
            block_table.stride(0),
            slots.stride(0),
            PAGE=page_size,
            MAX_POS=slots.shape[1],
            BUG=bug,
        )

    return launch


@triton.jit
def _scatter(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_t,
    stride_b,
    stride_s,
    stride_h,
    block_size,
    HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BUG: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    # BUG 1: a padding token (slot -1) writes into slot 0. BUG 2: it is not skipped at all, and
    # -1 // B = 0, -1 % B = -1 (Triton divides as C does): it writes the row before the cache.
    # BUG 3: the offset in the block is left out.
    if BUG == 0 or BUG == 3:
        if slot < 0:
            return
    if BUG == 1:
        slot = tl.maximum(slot, 0)
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_SIZE)[None, :]
    src = token * stride_t + heads * HEAD_SIZE + dims
    offset = 0 if BUG == 3 else slot % block_size
    dst = (slot // block_size) * stride_b + offset * stride_s + heads * stride_h + dims
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + src))
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + src))


def _launch_scatter(bug: int) -> Callable[..., None]:
    def launch(kernel, key, value, k_cache, v_cache, slots):
        kernel[(slots.shape[0],)](
            key,
            value,
            k_cache,
            v_cache,
            slots,
            key.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_cache.shape[1],
            HEADS=key.shape[1],
            HEAD_SIZE=key.shape[2],
            BUG=bug,
        )

    return launch


@triton.jit
def _scores(
    q_ptr,
    k_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    scores_ptr,
    scale,
    stride_q,
    stride_kb,
    stride_ks,
    stride_bt,
    stride_scores,
    PAGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    MASK: tl.constexpr,
):
    req = tl.program_id(0)
    page = tl.program_id(1)
    rows = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_SIZE)
    block = tl.load(bt_ptr + req * stride_bt + page)
    q = tl.load(q_ptr + req * stride_q + dims)
    in_seq = page * PAGE + rows < tl.load(seq_lens_ptr + req)
    k_ptrs = k_cache_ptr + block * stride_kb + rows[:, None] * stride_ks + dims[None, :]
    # MASK (puzzle 4; without it puzzle 4's check must fail): 1 masks the scores and the loads past
    # seq_len, 2 the scores only (right values, but it loads keys its request does not own).
    k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0) if MASK == 1 else tl.load(k_ptrs)
    s = tl.sum(q[None, :] * k, 1) * scale
    if MASK:
        s = tl.where(in_seq, s, float("-inf"))
    tl.store(scores_ptr + req * stride_scores + page * PAGE + rows, s)


def _launch_scores(mask: int, bug: bool = False, sizes: tuple[int, int] | None = None) -> Callable[..., None]:
    """`sizes`: (page size, head size) written in instead of read from the tensors (a wrong launcher)."""

    def launch(kernel, q, k_cache, block_table, seq_lens, scores, scale):
        page, head_size = sizes or (k_cache.shape[1], q.shape[1])
        kernel[(q.shape[0], block_table.shape[1])](
            q,
            k_cache,
            block_table,
            seq_lens,
            scores,
            scale * (1.5 if bug else 1.0),
            q.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            block_table.stride(0),
            scores.stride(0),
            PAGE=page,
            HEAD_SIZE=head_size,
            MASK=mask,
        )

    return launch


@triton.jit
def _attend_pages(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    bt_row,
    seq_len,
    first_page,
    end_page,
    scale,
    stride_kb,
    stride_ks,
    PAGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    RESCALE: tl.constexpr,
):
    """Online softmax of a [G, D] query tile over pages [first_page, end_page)."""
    rows = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_SIZE)
    for page in range(first_page, end_page):
        block = tl.load(bt_row + page)
        in_seq = page * PAGE + rows < seq_len
        offs = block * stride_kb + rows[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_base + offs, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_base + offs, mask=in_seq[:, None], other=0.0)
        s = tl.where(in_seq[None, :], tl.sum(q[:, None, :] * k[None, :, :], 2) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.where(RESCALE, tl.exp(m_i - m_new), 1.0)  # BUG when False: old sums keep their old max
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    RESCALE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    """Puzzles 5 and 6: program (request, KV head); G = 1 is puzzle 5."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, G)
    heads = g * tl.num_programs(1) + kv_head if INTERLEAVE else kv_head * G + g  # BUG: head h on KV h % Hkv
    dims = tl.arange(0, HEAD_SIZE)
    q_ptrs = req * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_ptrs)
    seq_len = tl.load(seq_lens_ptr + req)
    acc, m_i, l_i = _attend_pages(
        tl.zeros([G, HEAD_SIZE], tl.float32),
        tl.full([G], float("-inf"), tl.float32),
        tl.zeros([G], tl.float32),
        q,
        k_cache_ptr + kv_head * stride_kh,
        v_cache_ptr + kv_head * stride_kh,
        bt_ptr + req * stride_bt,
        seq_len,
        0,
        tl.cdiv(seq_len, PAGE),
        scale,
        stride_kb,
        stride_ks,
        PAGE,
        HEAD_SIZE,
        RESCALE,
    )
    tl.store(out_ptr + q_ptrs, acc / l_i[:, None])


def _launch_attention(bug: bool, heads: bool) -> Callable[..., None]:
    def launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        if not heads:  # one head: view it as [R, 1, D] and [blocks, page, 1, D]
            q, out, k_cache, v_cache = q[:, None], out[:, None], k_cache[:, :, None], v_cache[:, :, None]
        kernel[(q.shape[0], k_cache.shape[2])](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            out,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_table.stride(0),
            G=q.shape[1] // k_cache.shape[2],
            PAGE=k_cache.shape[1],
            HEAD_SIZE=q.shape[2],
            RESCALE=heads or not bug,
            INTERLEAVE=heads and bug,
        )

    return launch


@triton.jit
def _split_partial(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    part_ptr,
    lse_ptr,
    scale,
    stride_bt,
    stride_kb,
    stride_ks,
    PAGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    GUARD: tl.constexpr,
):
    req = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    dims = tl.arange(0, HEAD_SIZE)
    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, PAGE), num_splits)
    first = split * per_split
    end = tl.minimum(first + per_split, tl.cdiv(seq_len, PAGE))
    q = tl.load(q_ptr + req * HEAD_SIZE + dims)[None, :]
    acc, m_i, l_i = _attend_pages(
        tl.zeros([1, HEAD_SIZE], tl.float32),
        tl.full([1], float("-inf"), tl.float32),
        tl.zeros([1], tl.float32),
        q,
        k_cache_ptr,
        v_cache_ptr,
        bt_ptr + req * stride_bt,
        seq_len,
        first,
        end,
        scale,
        stride_kb,
        stride_ks,
        PAGE,
        HEAD_SIZE,
        True,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i) if GUARD else l_i  # BUG without GUARD: 0 / 0 for an empty split
    row = req * num_splits + split
    tl.store(part_ptr + row * HEAD_SIZE + dims[None, :], acc / l_safe[:, None])
    tl.store(lse_ptr + row + tl.arange(0, 1), m_i + tl.log(l_safe))


@triton.jit
def _split_merge(part_ptr, lse_ptr, out_ptr, num_splits, SPLITS: tl.constexpr, HEAD_SIZE: tl.constexpr):
    req = tl.program_id(0)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_SIZE)
    rows = req * num_splits + splits
    lse = tl.load(lse_ptr + rows, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(part_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], mask=(splits < num_splits)[:, None])
    tl.store(out_ptr + req * HEAD_SIZE + dims, tl.sum(parts * (weights / tl.sum(weights, 0))[:, None], 0))


def _launch_split(bug: bool) -> Callable[..., None]:
    def launch(partial, merge, q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits):
        parts = torch.empty(q.shape[0] * num_splits, q.shape[1], device=q.device)
        lse = torch.empty(q.shape[0] * num_splits, device=q.device)
        partial[(q.shape[0], num_splits)](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            parts,
            lse,
            scale,
            block_table.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            PAGE=k_cache.shape[1],
            HEAD_SIZE=q.shape[1],
            GUARD=not bug,
        )
        merge[(q.shape[0],)](
            parts, lse, out, num_splits, SPLITS=triton.next_power_of_2(num_splits), HEAD_SIZE=q.shape[1]
        )

    return launch


PUZZLES: dict[str, tuple[Callable[..., CheckResult], Any, Callable[[bool], Callable[..., None]], str]] = {
    # name: (checker, kernel(s), launcher factory taking `bug`, what the wrong answer's message shows)
    "block_table_row": (
        P.check_block_table_row,
        _slots,
        _launch_slots,
        "slots[0, 1] is 20 (that is the first slot of the block: add the offset",
    ),
    "scatter": (
        P.check_scatter_kernel,
        _scatter,
        lambda bug: _launch_scatter(3 if bug else 0),
        "k_cache[0, 1, 0, 0] is 0 (slot 1, where token 1 writes)",
    ),
    "page_scores": (P.check_page_scores, _scores, lambda bug: _launch_scores(False, bug), "scores[0, 0] is "),
    "masked_scores": (
        P.check_masked_scores,
        _scores,
        lambda bug: _launch_scores(0 if bug else 1),
        "(position 5 is past seq_len 5: it must score -inf)",
    ),
    "online_softmax": (P.check_online_softmax, _attention, lambda bug: _launch_attention(bug, False), "out[1, "),
    "gqa": (
        P.check_gqa_attention,
        _attention,
        lambda bug: _launch_attention(bug, True),
        "out[0, 1, 0] is 0.4449 (that is query head 1 attending to KV head 1 % 2 = 1: query head h reads KV head",
    ),
    "split_kv": (
        P.check_split_kv,
        (_split_partial, _split_merge),
        _launch_split,
        "is nan (never written, or a 0 / 0 or -inf - (-inf) on the way; a split with no pages has l = 0)",
    ),
}


def _check(name: str, kernels: Any, launch: Callable[..., None]) -> CheckResult:
    return PUZZLES[name][0](kernels, launch)


def _revealed(capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    reveal()
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(PUZZLES))
def test_puzzle_checker_accepts_right_and_names_the_rule_a_wrong_entry_breaks(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong kernel's message names the entry, its value and the rule, not the expected value;
    the third wrong try offers reveal(), which works that entry out (the expected value included)."""
    if name == "scatter" and not INTERPRETED:
        pytest.skip(
            "the wrong scatter's entry depends on which program stores last: in order only under the interpreter"
        )
    _, kernels, make_launch, wrong_text = PUZZLES[name]
    right = _check(name, kernels, make_launch(False))
    assert right.ok and repr(right).startswith(PASS_MARK), right.message
    for tries in (1, 2, 3):
        wrong = _check(name, kernels, make_launch(True))
        assert_rejected(wrong, wrong_text)
        assert len(wrong.message.splitlines()) <= 3
        assert ("reveal()" in wrong.message) == (tries == 3), wrong.message
    entry = re.search(r"(\w+)\[([\d, ]+)\] is (\S+)", wrong.message)
    assert entry is not None, wrong.message
    worked = _revealed(capsys)
    assert worked.startswith("06: puzzle") and "worked out" in worked, worked
    # The worked answer ends with the expected value of that entry, which the message never shows.
    expected = re.findall(r"(-?\d[\d.]*(?:e-?\d+)?|-inf)\.?$", worked.strip())
    assert expected and expected[-1] != entry.group(3), worked
    if expected[-1] not in ("0", "-1", "-inf"):  # those are rules ("stays 0", "gets -1"), not a secret
        told = wrong.message.splitlines()[0][entry.end() :]  # what the message says of the entry (not the case)
        assert not re.search(rf"(?<![\d.]){re.escape(expected[-1])}(?![\d])", told)


def test_reveal_works_out_the_failing_entry_step_by_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert _check("block_table_row", _slots, _launch_slots(False)).ok  # resets the count
    for _ in range(3):
        wrong = _check("block_table_row", _slots, _launch_slots(True))
    assert "slots[0, 1] is 20" in wrong.message and "21" not in wrong.message.split("slots[0, 1]")[1]
    assert (
        _revealed(capsys)
        .strip()
        .endswith(
            "request 0, position 1: page 1 // 4 = 0, block_table[0, 0] = 5, offset 1 % 4 = 1; slot = 5 * 4 + 1 = 21."
        )
    )
    assert _check("split_kv", (_split_partial, _split_merge), _launch_split(False)).ok
    for _ in range(3):
        _check("split_kv", (_split_partial, _split_merge), _launch_split(True))
    worked = _revealed(capsys)
    assert "split 2: pages 2..1, lse_2 = -inf (empty: weight 0)" in worked and "softmax weights" in worked, worked


@pytest.mark.parametrize("name", list(PUZZLES))
def test_puzzle_checker_refuses_plain_functions_pagedkvs_kernels_and_idle_launchers(name: str) -> None:
    _, kernels, make_launch, _ = PUZZLES[name]
    two = isinstance(kernels, tuple)
    plain = _check(name, (K.reshape_and_cache, kernels[1]) if two else K.reshape_and_cache, make_launch(False))
    assert_rejected(plain, "reshape_and_cache is a function, not a @triton.jit kernel")
    own = _reshape_and_cache_kernel
    package = _check(name, (kernels[0], own) if two else own, make_launch(False))
    assert_rejected(package, "_reshape_and_cache_kernel is pagedkv's own kernel")
    idle = _check(name, kernels, lambda *args: None)  # launches nothing, leaves the outputs as they were
    assert_rejected(idle, "the launcher never launched")


def test_a_kernel_that_calls_pagedkvs_kernel_inside_is_refused() -> None:
    """A @triton.jit function may call another: wrapping pagedkv's own kernel (directly, through a
    helper of one's own, or through the module) is read from the kernel's code."""
    import pagedkv.kernels.reshape_and_cache as own_module

    @triton.jit
    def wraps(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_t,
        stride_b,
        stride_s,
        stride_h,
        block_size,
        HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        BUG: tl.constexpr,
    ):
        _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr)

    @triton.jit
    def helper(key_ptr):
        own_module._reshape_and_cache_kernel(key_ptr)

    @triton.jit
    def through_helper(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_t,
        stride_b,
        stride_s,
        stride_h,
        block_size,
        HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        BUG: tl.constexpr,
    ):
        helper(key_ptr)

    assert_rejected(
        P.check_scatter_kernel(wraps, _launch_scatter(0)),
        "wraps calls _reshape_and_cache_kernel (from pagedkv.kernels.reshape_and_cache)",
    )
    assert_rejected(
        P.check_scatter_kernel(through_helper, _launch_scatter(0)),
        "through_helper calls ",
        "(from pagedkv.kernels.reshape_and_cache)",
    )


def test_split_kv_checker_wants_both_kernels() -> None:
    assert_rejected(P.check_split_kv(_split_partial, _launch_split(False)), "as a tuple")


# --- answers that fooled the checker (issue 32), and other ways around the kernel ----------------


@triton.jit
def _copy(src_ptr, dst_ptr, N, BLOCK: tl.constexpr):
    """A kernel that only copies: what a launcher that computes in torch hands the answer to."""
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < N), mask=i < N)


def _launch_copy(kernel: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
    kernel[(1,)](src, dst, dst.numel(), BLOCK=triton.next_power_of_2(dst.numel()))


def _attention_in_torch(q, k_cache, v_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Puzzle 5's answer computed in torch (what the launcher that fooled the checker did)."""
    rows = []
    for r, n in enumerate(seq_lens.tolist()):
        pages = block_table[r, : -(-n // k_cache.shape[1])].long()
        k, v = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
        rows.append(torch.softmax(k @ q[r] * scale, 0) @ v)
    return torch.stack(rows)


def _copy_launch(compute: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        answer = compute(q, k_cache, v_cache, block_table, seq_lens, scale).contiguous()
        _launch_copy(kernel, answer, out)

    return launch


def test_a_launcher_that_computes_in_torch_and_copies_with_a_kernel_is_refused() -> None:
    """Issue 32: puzzle 5 passed with the attention computed in torch in the launcher plus a
    @triton.jit copy kernel. The launcher now runs under a dispatch mode: the op is named."""
    result = P.check_online_softmax(_copy, _copy_launch(_attention_in_torch))
    assert_rejected(result, "the launcher computes with torch (aten.", "outside the kernel")


@interpreter_only
def test_a_launcher_that_launches_a_kernel_it_was_not_given_is_refused() -> None:
    def launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        _launch_attention(False, False)(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale)
        _launch_copy(_copy, out, out)

    assert_rejected(P.check_online_softmax(_attention, launch), "launches a @triton.jit kernel it was not given")


def test_a_launcher_that_allocates_views_copies_and_sizes_its_grid_passes() -> None:
    """What a launcher may do: views, copies, its own buffers, the longest sequence for a grid."""

    def launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        assert int(seq_lens.max()) > 0
        q = q.clone().float()[:, :]
        _launch_attention(False, False)(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale)

    result = P.check_online_softmax(_attention, launch)
    assert result.ok, result.message


def test_the_same_on_a_thread_pool_or_a_thread_is_refused() -> None:
    def on_pool(*args):
        return ThreadPoolExecutor(1).submit(_attention_in_torch, *args).result()

    def on_thread(*args):
        done: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: done.append(_attention_in_torch(*args)))
        thread.start()
        thread.join()
        return done[0]

    for compute in (on_pool, on_thread):
        assert_rejected(P.check_online_softmax(_copy, _copy_launch(compute)), "the launcher computes with torch (aten.")


def _slots_in_torch(block_table, seq_lens, slots, page_size):
    pos = torch.arange(slots.shape[1], device=slots.device).expand(slots.shape)
    slot = block_table.long().gather(1, (pos // page_size).clamp(max=block_table.shape[1] - 1)) * page_size
    return torch.where(pos < seq_lens[:, None], slot + pos % page_size, -1).to(slots.dtype)


def _scatter_in_torch(key, value, k_cache, v_cache, slots):
    """Both caches, written in torch (as views of one tensor: one copy kernel moves both)."""
    done = torch.stack([k_cache, v_cache]).clone()
    valid = slots >= 0
    for i, source in enumerate((key, value)):
        done[i].view(-1, *key.shape[1:])[slots[valid]] = source[valid]
    return done


def _scores_in_torch(q, k_cache, block_table, seq_lens, scores, scale):
    keys = k_cache[block_table.long()].flatten(1, 2)  # [R, pages * page_size, D]
    return torch.einsum("rd,rkd->rk", q, keys) * scale


def _gqa_in_torch(q, k_cache, v_cache, block_table, seq_lens, out, scale):
    group = q.shape[1] // k_cache.shape[2]
    rows = []
    for r, n in enumerate(seq_lens.tolist()):
        pages = block_table[r, : -(-n // k_cache.shape[1])].long()
        k, v = (c[pages].flatten(0, 1)[:n].repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
        rows.append(torch.einsum("hk,khd->hd", torch.softmax(torch.einsum("hd,khd->hk", q[r], k) * scale, -1), v))
    return torch.stack(rows)


IN_TORCH = {  # puzzle: (checker, kernels it takes, the launcher's arguments -> the answer in torch, output index)
    "block_table_row": (P.check_block_table_row, 1, _slots_in_torch, 2),
    "page_scores": (P.check_page_scores, 1, _scores_in_torch, 4),
    "masked_scores": (
        P.check_masked_scores,
        1,
        lambda q, k, bt, lens, scores, scale: torch.where(
            torch.arange(scores.shape[1]) < lens[:, None], _scores_in_torch(q, k, bt, lens, scores, scale), -torch.inf
        ),
        4,
    ),
    "online_softmax": (
        P.check_online_softmax,
        1,
        lambda q, k, v, bt, lens, out, scale: _attention_in_torch(q, k, v, bt, lens, scale),
        5,
    ),
    "gqa": (P.check_gqa_attention, 1, _gqa_in_torch, 5),
    "split_kv": (
        P.check_split_kv,
        2,
        lambda q, k, v, bt, lens, out, scale, splits: _attention_in_torch(q, k, v, bt, lens, scale),
        5,
    ),
}


@pytest.mark.parametrize("on_a_thread", [False, True], ids=["here", "on a thread pool"])
@pytest.mark.parametrize("name", list(IN_TORCH))
def test_every_puzzle_refuses_its_work_done_in_torch_and_copied_by_a_kernel(name: str, on_a_thread: bool) -> None:
    """Issue 32's puzzle-5 answer, for every puzzle of the ladder (the scatter's torch writes go
    into its output: test_reading_values_into_python_or_writing_the_outputs_is_refused)."""
    checker, num_kernels, compute, output = IN_TORCH[name]

    def launch(*args):
        kernels, args = args[:num_kernels], args[num_kernels:]
        answer = ThreadPoolExecutor(1).submit(compute, *args).result() if on_a_thread else compute(*args)
        for kernel in kernels:  # split-KV's two kernels both copy
            _launch_copy(kernel, answer.contiguous(), args[output])

    kernels = (_copy, _copy) if num_kernels == 2 else _copy
    assert_rejected(checker(kernels, launch), "the launcher computes with torch (aten.")


def test_a_precomputed_answer_copied_in_is_refused() -> None:
    """The checker's cases are seeded, so an answer can be worked out before the check; copying it
    from a tensor the launcher did not get or allocate is refused (by a kernel or by torch)."""
    precomputed = torch.randn(64)

    def by_kernel(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        _launch_copy(kernel, precomputed, out)

    def by_torch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        answer = torch.empty_like(out)
        answer.copy_(precomputed[: out.numel()].view(out.shape))
        _launch_copy(kernel, answer, out)

    assert_rejected(P.check_online_softmax(_copy, by_kernel), "passes _copy a tensor the checker did not give it")
    assert_rejected(P.check_online_softmax(_copy, by_torch), "uses a tensor the checker did not give it")


@interpreter_only
def test_reading_values_into_python_or_writing_the_outputs_is_refused() -> None:
    def through_numpy(kernel, key, value, k_cache, v_cache, slots):
        for _ in slots.numpy():  # .numpy() shares memory: a write would skip torch
            pass
        _launch_scatter(0)(kernel, key, value, k_cache, v_cache, slots)

    def from_python(kernel, block_table, seq_lens, slots, page_size):
        table, lens = block_table.tolist(), seq_lens.tolist()  # tolist runs no aten op ...
        answer = torch.tensor(
            [
                [
                    table[r][p // page_size] * page_size + p % page_size if p < lens[r] else -1
                    for p in range(slots.shape[1])
                ]
                for r in range(len(lens))
            ],
            dtype=torch.int32,
        )
        _launch_copy(kernel, answer, slots)  # ... but making a tensor of the result does

    def writes_output(kernel, block_table, seq_lens, slots, page_size):
        _launch_slots(False)(kernel, block_table, seq_lens, slots, page_size)
        slots[:, -1] = -1

    assert_rejected(P.check_scatter_kernel(_scatter, through_numpy), "(aten.detach)")
    assert_rejected(
        P.check_block_table_row(_copy, from_python), "makes a tensor from Python values", "(aten.lift_fresh)"
    )
    assert_rejected(P.check_block_table_row(_slots, writes_output), "the launcher")
    assert "(aten.lift_fresh)" in P.check_block_table_row(_slots, writes_output).message  # the -1 itself

    def copies_into_output(kernel, block_table, seq_lens, slots, page_size):
        _launch_slots(False)(kernel, block_table, seq_lens, slots, page_size)
        slots.copy_(slots.clone())

    assert_rejected(
        P.check_block_table_row(_slots, copies_into_output), "writes into its output slots itself (aten.copy_)"
    )


def test_a_scatter_done_by_copies_in_the_launcher_is_refused() -> None:
    """The scatter needs no math: the launcher could move each token's row into a buffer laid out
    like the cache (slots read with tolist, which runs no aten op) and have a kernel copy it over."""

    def launch(kernel, key, value, k_cache, v_cache, slots):
        staged = torch.zeros(2, *k_cache.shape)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                staged[0].view(-1, *key.shape[1:])[slot].copy_(key[t])
                staged[1].view(-1, *key.shape[1:])[slot].copy_(value[t])
        _launch_copy(kernel, staged, k_cache)  # (the test stops at the first refusal)

    assert_rejected(P.check_scatter_kernel(_copy, launch), "copies from its input key into a buffer of its own")


def test_python_math_passed_as_launch_arguments_is_refused() -> None:
    """Values worked out in Python (tolist runs no aten op) reach the output only through scalar
    launch arguments, one launch per entry: a kernel is launched once, with a grid."""

    @triton.jit
    def store(dst_ptr, index, value):
        tl.store(dst_ptr + index, value)

    def per_entry(kernel, block_table, seq_lens, slots, page_size):
        table, lens, width = block_table.tolist(), seq_lens.tolist(), slots.shape[1]
        for r, n in enumerate(lens):
            for p in range(width):
                slot = table[r][p // page_size] * page_size + p % page_size if p < n else -1
                kernel[(1,)](slots, r * width + p, slot)

    assert_rejected(P.check_block_table_row(store, per_entry), "the launcher launched store 48 times; launch it once")


@interpreter_only
def test_a_kernel_that_calls_torch_is_refused() -> None:
    """Under the interpreter a kernel body is Python and could call torch; on a GPU it would not compile."""

    @triton.jit
    def cheats(src_ptr, dst_ptr, N: tl.constexpr):
        torch.zeros(N).exp()
        tl.store(dst_ptr + tl.arange(0, N), tl.load(src_ptr + tl.arange(0, N)))

    def launch(kernel, block_table, seq_lens, slots, page_size):
        _launch_copy(kernel, block_table, slots)

    assert_rejected(P.check_block_table_row(cheats, launch), "the kernel calls torch (aten.")


def test_a_launcher_that_calls_pagedkv_or_reads_the_checkers_frames_is_refused() -> None:
    from pagedkv.attention.backends.torch_ref import paged_attention_reference

    def package(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        n = seq_lens.tolist()
        paged_attention_reference(
            q[:, None],
            k_cache[:, :, None],
            v_cache[:, :, None],
            out[:, None],
            list(range(len(n) + 1)),
            n,
            block_table,
            scale,
        )
        _launch_copy(kernel, out, out)

    def package_on_a_thread(*args):
        ThreadPoolExecutor(1).submit(package, *args).result()

    def frames(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        _ = sys._getframe(1).f_locals
        _launch_copy(kernel, out, out)

    for launch in (package, package_on_a_thread):
        assert_rejected(P.check_online_softmax(_copy, launch), "Your answer calls paged_attention_reference")
    assert_rejected(P.check_online_softmax(_copy, frames), "reading the checker's frames")


@interpreter_only
def test_triton_interpreter_runs_torch_ops_while_launching_and_they_are_allowed() -> None:
    """The other direction: the interpreter itself copies each tensor to the host and back with
    aten ops; those run inside the launch and are not the launcher's (a right answer passes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    src, dst = torch.randn(8), torch.empty(8)
    with Ops():
        _launch_copy(_copy, src, dst)
    assert torch.equal(src, dst)
    assert seen and set(seen) <= INTERPRETER_OPS, seen
    assert P.check_online_softmax(_attention, _launch_attention(False, False)).ok


@interpreter_only
def test_a_launcher_that_writes_the_answer_around_torch_is_caught_by_the_idle_run() -> None:
    """A write through the tensor's address (ctypes) runs no aten op and escapes the dispatch mode;
    running the launcher once more with launches that do nothing catches it."""

    def launch(kernel, block_table, seq_lens, slots, page_size):
        _launch_slots(False)(kernel, block_table, seq_lens, slots, page_size)
        table, lens = block_table.tolist(), seq_lens.tolist()
        answer = array.array(
            "i",
            [
                table[r][p // page_size] * page_size + p % page_size if p < n else -1
                for r, n in enumerate(lens)
                for p in range(slots.shape[1])
            ],
        )
        ctypes.memmove(slots.data_ptr(), answer.buffer_info()[0], slots.numel() * 4)

    assert_rejected(P.check_block_table_row(_slots, launch), "gets the right answer without running the kernel")


@interpreter_only
def test_right_values_with_loads_of_keys_the_request_does_not_own_fail_the_memory_check() -> None:
    """Point 7 of issue 32: the loads and stores are part of the verdict. Scores masked to -inf give
    the right values even when the kernel loads the rows past seq_len (another request's keys, or
    the null block's); the memory check names the program and the row."""
    result, work = revealed(lambda: P.check_masked_scores(_scores, _launch_scores(2)))
    assert_rejected(
        result,
        "the right values, but _scores program (0, 1)",
        "of k_cache that holds no key of the program's request (mask the loads past seq_len)",
    )
    assert "Hint: a kernel loads only what its program needs" in result.message
    assert "Every memory rule the kernel broke:\n_scores program (0, 1)" in work


@interpreter_only
def test_two_programs_storing_one_entry_fail_the_memory_check() -> None:
    """A padding token written into slot 0 gives the right values when the token that owns slot 0
    happens to run later (the interpreter runs programs in order; a GPU does not)."""
    result = P.check_scatter_kernel(_scatter, _launch_scatter(1))
    assert_rejected(result, "the right values, but _scatter: k_cache[0, 0, 0, 0] stored by program 2 and program 5")


def test_a_launcher_with_the_first_cases_sizes_written_in_fails_a_later_case() -> None:
    """Each puzzle's later cases have other page and head sizes than its first (4 and 16), so a
    launcher that writes those numbers in instead of reading them from the tensors is caught."""

    def fixed_slots(kernel, block_table, seq_lens, slots, page_size):
        _launch_slots(False)(kernel, block_table, seq_lens, slots, 4)

    fixed_scores = _launch_scores(1, sizes=(4, 16))

    def fixed_scale(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        _launch_attention(False, False)(kernel, q, k_cache, v_cache, block_table, seq_lens, out, 16**-0.5)

    for result in (
        P.check_block_table_row(_slots, fixed_slots),
        P.check_masked_scores(_scores, fixed_scores),
        P.check_online_softmax(_attention, fixed_scale),
    ):
        assert_rejected(result, "page size 8, head size 32")


@interpreter_only
def test_a_write_before_the_cache_is_caught_in_a_guard_block() -> None:
    """That write used to land in memory the cache does not own (the checker's process later
    aborted in free()). The recorder drops a store outside every tensor and names it; without the
    interpreter, the guard blocks around the caches catch it."""
    assert_rejected(
        P.check_scatter_kernel(_scatter, _launch_scatter(2)),
        "program 2: stored 16 elements outside every tensor it was given: 16 elements before the start of k_cache",
    )


def test_a_failing_launch_is_reported_in_one_line() -> None:
    def bad_launch(kernel, key, value, k_cache, v_cache, slots):
        kernel[(slots.shape[0],)](key, value)  # missing arguments

    result = P.check_scatter_kernel(_scatter, bad_launch)
    assert_rejected(result, "the launch raised")
    assert "\n" not in result.message


# --- the notebook's cells ---------------------------------------------------------------------


def _tagged_cells(tag: str) -> list[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if tag in c.get("metadata", {}).get("tags", [])]


def _solutions() -> list[str]:
    """The worked solutions: collapsed markdown cells (not run by Run All), their ```python block."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    marked = [c for c in cells if "solution" in c.get("metadata", {}).get("tags", [])]
    assert all(c["cell_type"] == "markdown" for c in marked)
    return [re.search(r"```python\n(.*?)```", "".join(c["source"]), re.S).group(1) for c in marked]


def _run_fresh(scripts: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run each script with runpy (own globals, a real file: compiled @triton.jit reads its source)
    in one new Python process with TRITON_INTERPRET unset and no GPU visible."""
    paths = []
    for i, code in enumerate(scripts):
        paths.append(tmp_path / f"cell_{i}.py")
        paths[-1].write_text(code)
    runner = "import runpy, sys\nfor path in sys.argv[1:]:\n    runpy.run_path(path)\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", runner, *map(str, paths)], env=env, capture_output=True, text=True, timeout=240
    )


def test_each_worked_solution_passes_its_check_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """A kernel restart, then one puzzle's cell and its worked solution (from the notebook's
    collapsed markdown): no earlier cell has run, and every solution passes its checker."""
    exercises, solutions = _tagged_cells("exercise"), _solutions()
    assert len(exercises) == len(solutions) == len(PUZZLES)
    done = _run_fresh([e + "\n" + s for e, s in zip(exercises, solutions)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = [line for line in done.stdout.splitlines() if line[:1] in (PASS_MARK, FAIL_MARK, TODO_MARK)]
    unable = [v for v in verdicts if "interpreter cannot run a loop" in v]  # old Triton with new numpy
    if unable:
        pytest.skip(unable[0])
    # The skeleton cells grade nothing (not run, or "not answered yet"): no fail; then every solution passes.
    assert not any(v.startswith(FAIL_MARK) for v in verdicts), verdicts
    passes = [v for v in verdicts if v.startswith(PASS_MARK)]
    assert passes[0] == f"{PASS_MARK} block-table row: 2 random cases match the float64 reference.", verdicts
    assert len(passes) == len(PUZZLES), done.stdout


def test_no_worked_solution_runs_on_run_all() -> None:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for solution in _solutions():
        first_def = next(line for line in solution.splitlines() if line.startswith("def "))
        body = solution[solution.index(first_def) + len(first_def) :].split("\n\n")[0]
        assert body not in code  # the solution's kernel body appears in no code cell
    exercises = [c for c in cells if "exercise" in c["metadata"].get("tags", [])]
    assert PASS_MARK not in "".join("".join(o.get("text", "")) for c in exercises for o in c.get("outputs", []))


def test_without_triton_the_first_cell_says_what_to_install_and_the_source_cells_still_run(tmp_path: Path) -> None:
    """`pip install "pagedkv[notebooks]"` without Triton: `pagedkv workbook --execute` stopped at
    section 1 with "ValueError: substring not found" (the cell read the source file of the stub that
    stands in for the kernel). Now the first cell names what to install, and the source is read from
    the kernel's file, which needs no Triton."""
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    first, source = "".join(cells[0]["source"]), "".join(cells[1]["source"])
    no_triton = (  # as if triton were not installed: not found, not importable
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'triton' else real(name, *a)\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NoTriton())\n"
    )
    cell_1 = (
        no_triton
        + "try:\n"
        + "".join("    " + line + "\n" for line in first.splitlines())
        + ("except ModuleNotFoundError as exc:\n    print('raised:', exc)\n")
    )
    shown_as_text = (  # IPython stood in for by a module whose display prints the listing's HTML
        "import sys, types\n"
        "shown = types.ModuleType('IPython.display')\n"
        "shown.HTML, shown.display = str, print\n"
        "sys.modules.update({'IPython': types.ModuleType('IPython'), 'IPython.display': shown})\n"
    )
    done = _run_fresh([cell_1, no_triton + shown_as_text + source], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'raised: notebook 06 runs Triton kernels: pip install triton (or "pagedkv[notebooks]")' in done.stdout
    assert "slot = tl.load(slot_mapping_ptr + token)" in done.stdout


def test_checker_explains_triton_imported_without_the_interpreter(tmp_path: Path) -> None:
    answered = _tagged_cells("exercise")[1].replace("answer = ...", "answer = scatter_kernel")
    done = _run_fresh(["import triton\n" + answered], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{FAIL_MARK} scatter kernel: Triton cannot run kernels here" in done.stdout
    assert "TRITON_INTERPRET=1" in done.stdout and len(done.stdout.strip().splitlines()) == 1
