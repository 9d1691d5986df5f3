"""Notebook 06's Triton puzzle checkers: each accepts a right kernel written here, names the first
mismatch of a wrong one, and refuses answers that do no kernel work (a plain function, pagedkv's
own kernel, a launcher that computes the result itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedkv.exercises.triton_puzzles as P
import pagedkv.kernels as K
from pagedkv.exercises import CheckResult

if not K.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedkv.kernels.reshape_and_cache import _reshape_and_cache_kernel  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_triton_kernels.ipynb"


# Each kernel takes BUG: a compile-time switch to a typical mistake, so right and wrong share code.
@triton.jit
def _slots(bt_ptr, seq_lens_ptr, slots_ptr, stride_bt, stride_slots,
           PAGE: tl.constexpr, MAX_POS: tl.constexpr, BUG: tl.constexpr):
    req = tl.program_id(0)
    pos = tl.arange(0, MAX_POS)
    in_seq = pos < tl.load(seq_lens_ptr + req)
    block = tl.load(bt_ptr + req * stride_bt + pos // PAGE, mask=in_seq, other=0)
    slot = block * PAGE if BUG else block * PAGE + pos % PAGE  # BUG: forgets the offset in the page
    tl.store(slots_ptr + req * stride_slots + pos, tl.where(in_seq, slot, -1))


def _launch_slots(bug: bool) -> Callable[..., None]:
    def launch(kernel, block_table, seq_lens, slots, page_size):
        kernel[(block_table.shape[0],)](block_table, seq_lens, slots, block_table.stride(0), slots.stride(0),
                                        PAGE=page_size, MAX_POS=slots.shape[1], BUG=bug)
    return launch


@triton.jit
def _scatter(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_t, stride_b, stride_s, stride_h,
             block_size, HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BUG: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    # BUG 1: a padding token (slot -1) writes into slot 0. BUG 2: it is not skipped at all, and
    # -1 // B = 0, -1 % B = -1 (Triton divides as C does): it writes the row before the cache.
    if not BUG:
        if slot < 0:
            return
    if BUG != 2:
        slot = tl.maximum(slot, 0)
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_SIZE)[None, :]
    src = token * stride_t + heads * HEAD_SIZE + dims
    dst = (slot // block_size) * stride_b + (slot % block_size) * stride_s + heads * stride_h + dims
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + src))
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + src))


def _launch_scatter(bug: int) -> Callable[..., None]:
    def launch(kernel, key, value, k_cache, v_cache, slots):
        kernel[(slots.shape[0],)](key, value, k_cache, v_cache, slots, key.stride(0), k_cache.stride(0),
                                  k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
                                  HEADS=key.shape[1], HEAD_SIZE=key.shape[2], BUG=bug)
    return launch


@triton.jit
def _scores(q_ptr, k_cache_ptr, bt_ptr, seq_lens_ptr, scores_ptr, scale, stride_q, stride_kb, stride_ks, stride_bt,
            stride_scores, PAGE: tl.constexpr, HEAD_SIZE: tl.constexpr, MASK: tl.constexpr):
    req = tl.program_id(0)
    page = tl.program_id(1)
    rows = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_SIZE)
    block = tl.load(bt_ptr + req * stride_bt + page)
    q = tl.load(q_ptr + req * stride_q + dims)
    k = tl.load(k_cache_ptr + block * stride_kb + rows[:, None] * stride_ks + dims[None, :])
    s = tl.sum(q[None, :] * k, 1) * scale
    if MASK:  # puzzle 4; without it puzzle 4's check must fail
        s = tl.where(page * PAGE + rows < tl.load(seq_lens_ptr + req), s, float("-inf"))
    tl.store(scores_ptr + req * stride_scores + page * PAGE + rows, s)


def _launch_scores(mask: bool, bug: bool = False) -> Callable[..., None]:
    def launch(kernel, q, k_cache, block_table, seq_lens, scores, scale):
        kernel[(q.shape[0], block_table.shape[1])](
            q, k_cache, block_table, seq_lens, scores, scale * (1.5 if bug else 1.0), q.stride(0),
            k_cache.stride(0), k_cache.stride(1), block_table.stride(0), scores.stride(0),
            PAGE=k_cache.shape[1], HEAD_SIZE=q.shape[1], MASK=mask)
    return launch


@triton.jit
def _attend_pages(acc, m_i, l_i, q, k_base, v_base, bt_row, seq_len, first_page, end_page, scale,
                  stride_kb, stride_ks, PAGE: tl.constexpr, HEAD_SIZE: tl.constexpr, RESCALE: tl.constexpr):
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
def _attention(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, scale, stride_qt, stride_qh,
               stride_kb, stride_ks, stride_kh, stride_bt, G: tl.constexpr, PAGE: tl.constexpr,
               HEAD_SIZE: tl.constexpr, RESCALE: tl.constexpr, INTERLEAVE: tl.constexpr):
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
        tl.zeros([G, HEAD_SIZE], tl.float32), tl.full([G], float("-inf"), tl.float32), tl.zeros([G], tl.float32),
        q, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_kh, bt_ptr + req * stride_bt, seq_len,
        0, tl.cdiv(seq_len, PAGE), scale, stride_kb, stride_ks, PAGE, HEAD_SIZE, RESCALE)
    tl.store(out_ptr + q_ptrs, acc / l_i[:, None])


def _launch_attention(bug: bool, heads: bool) -> Callable[..., None]:
    def launch(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        if not heads:  # one head: view it as [R, 1, D] and [blocks, page, 1, D]
            q, out, k_cache, v_cache = q[:, None], out[:, None], k_cache[:, :, None], v_cache[:, :, None]
        kernel[(q.shape[0], k_cache.shape[2])](
            q, k_cache, v_cache, block_table, seq_lens, out, scale, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            G=q.shape[1] // k_cache.shape[2], PAGE=k_cache.shape[1], HEAD_SIZE=q.shape[2],
            RESCALE=heads or not bug, INTERLEAVE=heads and bug)
    return launch


@triton.jit
def _split_partial(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, part_ptr, lse_ptr, scale, stride_bt,
                   stride_kb, stride_ks, PAGE: tl.constexpr, HEAD_SIZE: tl.constexpr, GUARD: tl.constexpr):
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
        tl.zeros([1, HEAD_SIZE], tl.float32), tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32),
        q, k_cache_ptr, v_cache_ptr, bt_ptr + req * stride_bt, seq_len, first, end, scale, stride_kb, stride_ks,
        PAGE, HEAD_SIZE, True)
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
        partial[(q.shape[0], num_splits)](q, k_cache, v_cache, block_table, seq_lens, parts, lse, scale,
                                          block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
                                          PAGE=k_cache.shape[1], HEAD_SIZE=q.shape[1], GUARD=not bug)
        merge[(q.shape[0],)](parts, lse, out, num_splits, SPLITS=triton.next_power_of_2(num_splits),
                             HEAD_SIZE=q.shape[1])
    return launch


PUZZLES: dict[str, tuple[Callable[..., CheckResult], Any, Callable[[bool], Callable[..., None]], str]] = {
    # name: (checker, kernel(s), launcher factory taking `bug`, what the wrong answer's message shows)
    "block_table_row": (P.check_block_table_row, _slots, _launch_slots, "slots[0, 1] is "),
    "scatter": (P.check_scatter_kernel, _scatter, _launch_scatter, "(slot 0, "),  # padding lands in slot 0
    "page_scores": (P.check_page_scores, _scores, lambda bug: _launch_scores(False, bug), "scores[0, 0] is "),
    "masked_scores": (P.check_masked_scores, _scores, lambda bug: _launch_scores(not bug), "expected -inf"),
    "online_softmax": (P.check_online_softmax, _attention, lambda bug: _launch_attention(bug, False), "out[1, "),
    "gqa": (P.check_gqa_attention, _attention, lambda bug: _launch_attention(bug, True), "out[0, 1, "),
    "split_kv": (P.check_split_kv, (_split_partial, _split_merge), _launch_split, "is nan, expected"),
}


def _check(name: str, kernels: Any, launch: Callable[..., None]) -> CheckResult:
    return PUZZLES[name][0](kernels, launch)


@pytest.mark.parametrize("name", list(PUZZLES))
def test_puzzle_checker_accepts_right_and_names_the_first_wrong_entry(name: str) -> None:
    _, kernels, make_launch, wrong_text = PUZZLES[name]
    right = _check(name, kernels, make_launch(False))
    assert right.ok, right.message
    wrong = _check(name, kernels, make_launch(True))
    assert not wrong.ok and wrong_text in wrong.message, wrong.message
    assert len(wrong.message.splitlines()) <= 2


@pytest.mark.parametrize("name", list(PUZZLES))
def test_puzzle_checker_refuses_plain_functions_pagedkvs_kernels_and_idle_launchers(name: str) -> None:
    _, kernels, make_launch, _ = PUZZLES[name]
    two = isinstance(kernels, tuple)
    plain = _check(name, (K.reshape_and_cache, kernels[1]) if two else K.reshape_and_cache, make_launch(False))
    assert not plain.ok and "reshape_and_cache is a function, not a @triton.jit kernel" in plain.message
    own = _reshape_and_cache_kernel
    package = _check(name, (kernels[0], own) if two else own, make_launch(False))
    assert not package.ok and "_reshape_and_cache_kernel is pagedkv's own kernel" in package.message
    idle = _check(name, kernels, lambda *args: None)  # launches nothing, leaves the outputs as they were
    assert not idle.ok and "the launcher never launched" in idle.message


def test_split_kv_checker_wants_both_kernels() -> None:
    split = P.check_split_kv(_split_partial, _launch_split(False))
    assert not split.ok and "as a tuple" in split.message


def test_checker_refuses_a_launcher_that_does_the_work() -> None:
    def torch_launch(kernel, key, value, k_cache, v_cache, slots):
        kernel[(1,)]  # "launches" nothing useful, then computes the answer in torch
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                k_cache.view(-1, *key.shape[1:])[slot] = key[t]
                v_cache.view(-1, *key.shape[1:])[slot] = value[t]

    result = P.check_scatter_kernel(_scatter, torch_launch)
    assert not result.ok and "without running the kernel" in result.message


def test_a_launcher_with_the_first_cases_sizes_written_in_fails_a_later_case() -> None:
    """Each puzzle's later cases have other page and head sizes than its first (4 and 16), so a
    launcher that writes those numbers in instead of reading them from the tensors is caught."""
    def fixed_slots(kernel, block_table, seq_lens, slots, page_size):
        _launch_slots(False)(kernel, block_table, seq_lens, slots, 4)

    def fixed_scores(kernel, q, k_cache, block_table, seq_lens, scores, scale):
        kernel[(q.shape[0], block_table.shape[1])](
            q, k_cache, block_table, seq_lens, scores, scale, q.stride(0), k_cache.stride(0), k_cache.stride(1),
            block_table.stride(0), scores.stride(0), PAGE=4, HEAD_SIZE=16, MASK=True)

    def fixed_scale(kernel, q, k_cache, v_cache, block_table, seq_lens, out, scale):
        _launch_attention(False, False)(kernel, q, k_cache, v_cache, block_table, seq_lens, out, 16**-0.5)

    for result in (P.check_block_table_row(_slots, fixed_slots), P.check_masked_scores(_scores, fixed_scores),
                   P.check_online_softmax(_attention, fixed_scale)):
        assert not result.ok and "page size 8, head size 32" in result.message, result.message


def test_a_write_before_the_cache_is_caught_in_a_guard_block() -> None:
    """The checker's caches sit between guard blocks: that write used to land in memory the cache
    does not own (the checker's process later aborted in free()), and was reported as V's write."""
    result = P.check_scatter_kernel(_scatter, _launch_scatter(2))
    assert not result.ok and "a write outside the K cache, before the cache" in result.message


def test_a_failing_launch_is_reported_in_one_line() -> None:
    def bad_launch(kernel, key, value, k_cache, v_cache, slots):
        kernel[(slots.shape[0],)](key, value)  # missing arguments

    result = P.check_scatter_kernel(_scatter, bad_launch)
    assert not result.ok and "the launch raised" in result.message and "\n" not in result.message


def _tagged_cells(tag: str) -> list[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if tag in c.get("metadata", {}).get("tags", [])]


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
    return subprocess.run([sys.executable, "-c", runner, *map(str, paths)], env=env, capture_output=True,
                          text=True, timeout=240)


def test_each_puzzle_cell_runs_alone_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """A kernel restart, then one puzzle's cell (and its solution): no earlier cell has run."""
    exercises, solutions = _tagged_cells("exercise"), _tagged_cells("solution")
    assert len(exercises) == len(solutions) == len(PUZZLES)
    done = _run_fresh([e + "\n" + s for e, s in zip(exercises, solutions)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = [line for line in done.stdout.splitlines() if line[:1] in "✅❌"]
    unable = [v for v in verdicts if "interpreter cannot run a loop" in v]  # old Triton with new numpy
    if unable:
        pytest.skip(unable[0])
    assert verdicts[0].startswith("❌ block-table row, seq_lens [5, 16, 1]"), verdicts  # the empty skeleton
    assert verdicts[1] == "✅ block-table row: 2 random cases match the float64 reference.", verdicts
    assert sum(v.startswith("✅") for v in verdicts) == len(PUZZLES), done.stdout


def test_checker_explains_triton_imported_without_the_interpreter(tmp_path: Path) -> None:
    done = _run_fresh(["import triton\n" + _tagged_cells("exercise")[1]], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "❌ scatter kernel: Triton cannot run kernels here" in done.stdout and "TRITON_INTERPRET=1" in done.stdout
    assert len(done.stdout.strip().splitlines()) == 1

