"""Checker of notebook 15's exercise (rung 1, a FlashAttention-2 prefill kernel): a right kernel written
here passes; the notebook's skeleton, a kernel without the causal mask or the scale, one that loads the
key tiles past the diagonal (right values all the same), one that holds a whole row of keys at once,
pagedkv's own rung and a launcher that computes in torch all fail, each with the rule it broke and
never the expected value; the notebook's worked solution passes and Run All does not run it."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedkv.kernels as K
from pagedkv.exercises import CheckResult, reveal
from pagedkv.exercises.prefill_ladder import check_flash_prefill
from tests.exercises.checks import (
    NOTEBOOKS,
    assert_not_answered,
    assert_rejected,
    revealed,
    saved_outputs_show_no_pass,
    worked_solutions,
)

if not K.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedkv.kernels.common import interpreting  # noqa: E402
from pagedkv.kernels.prefill_ladder import _tiled_kernel  # noqa: E402

NOTEBOOK = "15_prefill_ladder.ipynb"
interpreter_only = pytest.mark.skipif(
    not interpreting(), reason="the loads a kernel makes are recorded only under Triton's interpreter"
)


# BUG switches one typical mistake on, so the right kernel and the wrong ones share their code:
# 1 no causal mask, 2 every key tile to the end of the sequence (masked), 3 no softmax scale.
@triton.jit
def _flash(
    q_ptr, k_ptr, v_ptr, out_ptr, scale, num_tokens, stride_t, stride_h,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BUG: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK
    rows = start_m + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = rows[:, None] * stride_t + tl.program_id(1) * stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(rows < num_tokens)[:, None], other=0.0)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    end = num_tokens if BUG == 2 else tl.minimum(start_m + BLOCK, num_tokens)
    for start_n in range(0, end, BLOCK):
        keys = start_n + tl.arange(0, BLOCK)
        offsets = keys[:, None] * stride_t + tl.program_id(1) * stride_h + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=(keys < num_tokens)[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=(keys < num_tokens)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * (1.0 if BUG == 3 else scale)
        visible = keys[None, :] < num_tokens if BUG == 1 else keys[None, :] <= rows[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    tl.store(out_ptr + q_offsets, acc / l_i[:, None], mask=(rows < num_tokens)[:, None])


def _launch(bug: int) -> Any:
    def launch(kernel, q, k, v, out, scale, block):  # noqa: ANN001, ANN202  (a student's launcher)
        kernel[(triton.cdiv(q.shape[0], block), q.shape[1])](
            q, k, v, out, scale, q.shape[0], q.stride(0), q.stride(1), BLOCK=block, HEAD_DIM=q.shape[2], BUG=bug
        )

    return launch


@triton.jit
def _whole_row(
    q_ptr, k_ptr, v_ptr, out_ptr, scale, num_tokens, stride_t, stride_h,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """Right values without an online softmax: every key up to the tile's end in one [KEYS] tile."""
    start_m = tl.program_id(0) * BLOCK
    rows = start_m + tl.arange(0, BLOCK)
    keys = tl.arange(0, KEYS)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = rows[:, None] * stride_t + tl.program_id(1) * stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(rows < num_tokens)[:, None], other=0.0)
    offsets = keys[:, None] * stride_t + tl.program_id(1) * stride_h + dims[None, :]
    needed = (keys < tl.minimum(start_m + BLOCK, num_tokens))[:, None]
    k = tl.load(k_ptr + offsets, mask=needed, other=0.0)
    v = tl.load(v_ptr + offsets, mask=needed, other=0.0)
    s = tl.where(keys[None, :] <= rows[:, None], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, -float("inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    out = tl.dot(p / tl.sum(p, 1)[:, None], v, input_precision="ieee")
    tl.store(out_ptr + q_offsets, out, mask=(rows < num_tokens)[:, None])


def _launch_whole_row(kernel, q, k, v, out, scale, block):  # noqa: ANN001, ANN202
    kernel[(triton.cdiv(q.shape[0], block), q.shape[1])](
        q, k, v, out, scale, q.shape[0], q.stride(0), q.stride(1),
        BLOCK=block, HEAD_DIM=q.shape[2], KEYS=triton.next_power_of_2(q.shape[0]),
    )  # fmt: skip


def test_right_kernel_passes() -> None:
    result = check_flash_prefill(_flash, _launch(0))
    assert result, result.message
    assert result.message == "flash prefill: 3 random cases match the float64 reference."


def test_wrong_values_name_the_rule_not_the_value() -> None:
    no_mask, work = revealed(lambda: check_flash_prefill(_flash, _launch(1)))
    assert_rejected(
        no_mask,
        "out[0, 0, 0] is",
        "that is query t attending to every key of its tile, up to 15: the diagonal tile needs the causal mask",
        "Case: 40 tokens, 2 heads of 16, block 16.",
    )
    assert_rejected(check_flash_prefill(_flash, _launch(3)), "that is the attention without the scale")
    assert "softmax weights" in work


@interpreter_only
def test_key_tiles_past_the_diagonal_fail_the_memory_check() -> None:
    """Masked to -inf, the keys after a query do not change its values: only the loads show them."""
    assert_rejected(
        check_flash_prefill(_flash, _launch(2)),
        "flash prefill: the right values, but _flash program (0, 0)",
        "of k past its tile's last query, or of another head (causal: stop the key loop at the diagonal)",
    )


@interpreter_only
def test_a_whole_row_of_keys_in_one_load_fails() -> None:
    assert_rejected(
        check_flash_prefill(_whole_row, _launch_whole_row),
        "the right values, but program (1, 0) loads 32 keys of k in one load",
        "online softmax",
    )


def test_the_package_rung_and_a_launcher_that_computes_fail() -> None:
    assert_rejected(check_flash_prefill(_tiled_kernel, _launch(0)), "is pagedkv's own kernel")

    def in_torch(kernel, q, k, v, out, scale, block):  # noqa: ANN001, ANN202
        scores = torch.einsum("thd,shd->hts", q, k) * scale
        out.copy_(torch.einsum("hts,shd->thd", scores.softmax(-1), v))

    assert_rejected(check_flash_prefill(_flash, in_torch), "computes with torch (aten.")


def test_reveal_after_three_wrong_tries(capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        result = check_flash_prefill(_flash, _launch(3))
    assert "Try 3" in result.message
    reveal()
    worked = capsys.readouterr().out
    assert "query 1, head 0: keys 0..1 (causal)" in worked and "out[1, 0, 0] = sum of weight * v =" in worked


def _cells(tag: str) -> list[str]:
    cells = json.loads((NOTEBOOKS / NOTEBOOK).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if tag in c.get("metadata", {}).get("tags", [])]


def _run(code: str, tmp_path: Path) -> list[object]:
    """Run notebook code from a real file (@triton.jit reads its kernel's source); what it printed."""
    path = tmp_path / "cell.py"
    path.write_text(code)
    printed: list[object] = []
    runpy.run_path(str(path), init_globals={"print": printed.append})
    return printed


def test_the_skeleton_is_not_graded_and_the_worked_solution_passes(tmp_path: Path) -> None:
    """The exercise cell as saved grades nothing (it asks for the kernel first); given its skeleton
    kernel, whose TODO stores nothing, the checker says "not answered yet" and spends no try; with
    the collapsed worked solution run after it, the check passes. Run All runs only the first, and
    no saved output shows a pass."""
    [exercise_cell] = _cells("exercise")
    [solution] = worked_solutions(NOTEBOOK)
    [prompt] = _run(exercise_cell, tmp_path)
    assert not isinstance(prompt, CheckResult) and "then run this cell again" in str(prompt)
    [skeleton] = _run(exercise_cell.replace("answer = ...", "answer = flash_prefill_kernel"), tmp_path)
    assert_not_answered(skeleton)
    *_, solved = _run(exercise_cell + "\n" + solution, tmp_path)
    assert solved, solved
    assert saved_outputs_show_no_pass(NOTEBOOK)
    store = "tl.store(out_ptr + q_offsets, acc / l_i[:, None], mask=(rows < num_tokens)[:, None])"
    assert store in solution and store not in exercise_cell
