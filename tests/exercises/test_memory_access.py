"""record_accesses: the loads and stores of Triton kernels under the interpreter, checked by AccessLog.problems.

Tiny kernels with known accesses. A load or store past a tensor's end stays inside a larger buffer
(the tensor is a view of its start), so the interpreter never touches memory that is not allocated.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the recorder watches Triton's interpreter")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from pagedkv.exercises.memory_access import AccessLog, record_accesses  # noqa: E402
from tests.conftest import needs_triton_on_cpu  # noqa: E402

pytestmark = needs_triton_on_cpu("the memory-access recorder")


@triton.jit
def copy_rows(src_ptr, dst_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    values = tl.load(src_ptr + row * stride + cols, mask=mask)
    tl.store(dst_ptr + row * stride + cols, values, mask=mask)


@triton.jit
def copy_skipping_row_1(src_ptr, dst_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if row != 1:
        tl.store(dst_ptr + row * n_cols + cols, tl.load(src_ptr + row * n_cols + cols))


@triton.jit
def sum_into_first(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tl.store(dst_ptr + tl.arange(0, BLOCK), tl.load(src_ptr + row * BLOCK + tl.arange(0, BLOCK)))


@triton.jit
def atomic_count(counter_ptr):
    tl.atomic_add(counter_ptr, 1)


def _copy(rows: int, cols: int, block: int, n_cols: int | None = None) -> tuple[AccessLog, torch.Tensor]:
    # views of the start of larger buffers: a stray lane reads or writes memory that is allocated
    src = torch.arange(rows * cols + 8, dtype=torch.float32)[: rows * cols].view(rows, cols)
    dst = torch.zeros(rows * cols + 8)[: rows * cols].view(rows, cols)
    with record_accesses(named={"src": src, "dst": dst}) as log:
        copy_rows[(rows,)](src, dst, cols if n_cols is None else n_cols, cols, BLOCK=block)
    return log, dst


def test_a_copy_kernel_records_exactly_its_loads_and_stores() -> None:
    log, dst = _copy(rows=3, cols=4, block=4)
    assert torch.equal(dst.flatten(), torch.arange(12, dtype=torch.float32))  # the kernel still ran
    [run] = log.launches
    assert (run.kernel, run.grid, run.args) == ("copy_rows", (3, 1, 1), {"src_ptr": "src", "dst_ptr": "dst"})
    got = [(a.kind, a.program, a.tensor, a.offsets.tolist(), a.inside, a.op) for a in run.accesses]
    assert got == [
        (kind, (row, 0, 0), name, list(range(4 * row, 4 * row + 4)), True, op)
        for row in range(3)
        for op, (kind, name) in enumerate([("load", "src"), ("store", "dst")])
    ]
    assert log.touched("src", "load").all() and not log.touched("src", "store").any()
    assert log.touched("dst", "store", program=(1, 0, 0)).tolist() == [[False] * 4, [True] * 4, [False] * 4]
    assert log.problems(reads=["src"], writes=["dst"], rows_written={"dst": 1}) == []
    assert log.problems(reads=["src"], writes=["dst"], rows_written={"dst": (4,)}) == []


def test_masked_off_lanes_are_not_recorded() -> None:
    log, _ = _copy(rows=2, cols=4, block=8)  # lanes 4..7 of each row are masked off
    assert [a.offsets.size for a in log.launches[0].accesses] == [4, 4, 4, 4]
    assert all(a.inside for a in log.launches[0].accesses)
    assert log.problems(reads=["src"], writes=["dst"], rows_written={"dst": 1}) == []


def test_a_load_one_past_the_end_is_flagged() -> None:
    log, _ = _copy(rows=2, cols=4, block=8, n_cols=5)  # the mask lets lane 4 through: one past each row
    outside = [a for a in log.launches[0].accesses if not a.inside]
    # row 0's fifth lane lands on src[1, 0] (inside); row 1's lands past the end of src and of dst
    assert [(a.kind, a.program, a.tensor, a.offsets.tolist()) for a in outside] == [
        ("load", (1, 0, 0), "src", [8]),
        ("store", (1, 0, 0), "dst", [8]),
    ]
    problems = log.problems(reads=["src"], writes=["dst"])
    assert problems[:2] == [
        "copy_rows program 1: loaded 1 element outside every tensor it was given: 1 element past the end of src "
        "(src has 8 elements; the furthest is 1 past its last)",
        "copy_rows program 1: stored 1 element outside every tensor it was given: 1 element past the end of dst "
        "(dst has 8 elements; the furthest is 1 past its last)",
    ]
    # program 0 stored into dst[1, 0], which program 1 stores too: a race on a GPU
    assert problems[2:] == [
        "copy_rows: dst[1, 0] stored by program 0 and program 1 (programs run in parallel "
        "on a GPU: which store lands last is not defined)"
    ]


def test_a_row_never_written_is_flagged() -> None:
    src, dst = torch.randn(3, 4), torch.zeros(3, 4)
    with record_accesses(named={"src": src, "dst": dst}) as log:
        copy_skipping_row_1[(3,)](src, dst, 4, BLOCK=4)
    assert log.problems(reads=["src"], writes=["dst"], rows_written={"dst": 1}) == [
        "dst: 1 of 3 rows never written (dst[1]): no program stored to them"
    ]
    partly = log.problems(reads=["src"], writes=["dst"], rows_written={"dst": 2})
    assert partly == [
        "dst: 4 of 12 rows never written (dst[1, 0], dst[1, 1], dst[1, 2], dst[1, 3]): no program stored to them"
    ]
    assert log.problems(writes=["dst"], rows_written={"dst": 0}) == [
        "copy_skipping_row_1 program 0 (and 1 more program: 2): loaded 4 elements of src (first src[0, 0]), "
        "which it may not read (it may read no tensor)",
        "dst: 1 of 1 rows only partly written (first unwritten element dst[1, 0])",
    ]


def test_tensors_the_caller_did_not_name_and_allowed_elements() -> None:
    src, dst = torch.randn(2, 4), torch.zeros(4)
    with record_accesses(named={"dst": dst}) as log:
        sum_into_first[(2,)](src, dst, BLOCK=4)
    assert log.launches[0].args == {"src_ptr": "src_ptr", "dst_ptr": "dst"}
    assert log.tensors["src_ptr"].shape == (2, 4)
    assert log.problems(reads=["src_ptr"], writes=["dst"], races=False) == []
    row_0_only = log.problems(
        reads=["src_ptr"],
        writes=["dst"],
        races=False,
        allowed={"src_ptr": [0, 1, 2, 3]},
        reasons={"src_ptr": "in a row of another program"},
    )
    assert row_0_only == [
        "sum_into_first program 1: loaded 4 elements of src_ptr in a row of another program (first src_ptr[1, 0])"
    ]
    per_program = {"src_ptr": lambda program: torch.arange(8).view(2, 4) // 4 == program[0]}
    assert log.problems(reads=["src_ptr"], writes=["dst"], races=False, allowed=per_program) == []
    assert log.problems(reads=["src_ptr"], writes=["dst"])[0].startswith(
        "sum_into_first: dst[0] stored by program 0 and program 1"
    )
    assert log.problems(writes=["dst"], races=False, scratch=True) == []  # src_ptr: the launcher's own tensor
    with pytest.raises(KeyError, match="'src', which record_accesses was not given"):
        log.problems(reads=["src"])


def test_a_strided_view_and_its_gaps() -> None:
    base = torch.arange(16, dtype=torch.float32).view(4, 4)
    src, dst = base[:, :2], torch.zeros(4, 4)  # src: two columns of four; a kernel reading 4 columns strays
    with record_accesses(named={"src": src, "dst": dst}) as log:
        copy_rows[(4,)](src, dst, 4, 4, BLOCK=4)
    first = log.launches[0].accesses[0]
    assert (first.tensor, first.inside, first.offsets.tolist()) == ("src", True, [0, 1])
    # rows 0-2 read into the gaps after each row; row 3 reads past the last element
    assert log.problems(reads=["src"], writes=["dst"]) == [
        "copy_rows program 0 (and 2 more programs: 1, 2): loaded 2 elements outside every tensor it was given: "
        "2 elements in the gaps between the elements of src (the first just after src[0, 1])",
        "copy_rows program 3: loaded 2 elements outside every tensor it was given: 2 elements past the end of src "
        "(src has 8 elements; the furthest is 2 past its last)",
    ]


def test_atomics_are_loads_and_stores_and_do_not_race() -> None:
    counter = torch.zeros(1, dtype=torch.int32)
    with record_accesses(named={"counter": counter}) as log:
        atomic_count[(3,)](counter)
    assert counter.item() == 3
    assert [(a.kind, a.atomic) for a in log.launches[0].of((2, 0, 0))] == [("load", True), ("store", True)]
    assert log.problems(reads=["counter"], writes=["counter"]) == []


def _patched_state() -> list[object]:
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    return [
        builder.create_masked_load,
        builder.create_masked_store,
        builder.create_atomic_rmw,
        builder.create_atomic_cas,
        builder.set_grid_dim,
        executor._init_args_hst,
        triton.runtime.jit.JITFunction.run,
    ]


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_the_interpreter_is_restored_when_the_block_raises(error: type[BaseException]) -> None:
    before = _patched_state()
    with pytest.raises(error):
        with record_accesses() as log:
            assert _patched_state() != before
            copy_rows[(1,)](torch.ones(1, 4), torch.zeros(1, 4), 4, 4, BLOCK=4)
            raise error("stop")
    assert _patched_state() == before
    assert len(log.launches) == 1
    with pytest.raises(Exception, match="n_cols"):  # an error inside the kernel's launch
        with record_accesses():
            copy_rows[(1,)](torch.ones(1, 4), torch.zeros(1, 4), stride=4, BLOCK=4)
    assert _patched_state() == before


def test_no_launch_and_no_interpreter() -> None:
    with record_accesses() as log:
        pass
    assert log.problems() == ["no @triton.jit kernel ran inside record_accesses: nothing was loaded or stored"]


def test_without_the_interpreter_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with record_accesses():
            pass


def test_outside_accesses_count_in_the_nearest_tensor() -> None:
    log, _ = _copy(rows=2, cols=4, block=8, n_cols=6)
    [load] = [a for a in log.launches[0].accesses if not a.inside and a.kind == "load"]
    assert load.offsets.tolist() == [8, 9] and load.tensor == "src"
    assert np.array_equal(log.touched("src", "load"), np.ones((2, 4), dtype=bool))


@pytest.mark.parametrize("guard", [True, False])
def test_the_guard_keeps_stray_lanes_from_running(guard: bool) -> None:
    buffer = torch.full((12,), 7.0)
    src, dst = torch.arange(12, dtype=torch.float32)[:8].view(2, 4), buffer[:8].view(2, 4)
    with record_accesses(named={"src": src, "dst": dst}, guard=guard) as log:
        copy_rows[(2,)](src, dst, 5, 4, BLOCK=8)  # row 1's fifth lane: one past both ends
    assert "1 element past the end of dst" in log.problems(reads=["src"], writes=["dst"])[1]
    # with the guard the stray lane is not run; without it, the interpreter copies src's 9th value past dst
    assert buffer[8].item() == (7.0 if guard else 8.0)


def _view(log: AccessLog, **kwargs: object) -> object:
    from pagedkv.widgets import MemoryAccessView

    return MemoryAccessView(log, **kwargs)


def test_the_view_draws_each_program_and_flags_what_lies_outside() -> None:
    log, _ = _copy(rows=2, cols=4, block=8, n_cols=5)
    view = _view(log)
    assert repr(view) == "MemoryAccessView(copy_rows, grid (2,), all programs, tensors src, dst)"
    assert view.value.count('class="pkv-ma-load"') == 8 and view.value.count('class="pkv-ma-store"') == 8
    assert 'data-tensor="src" data-outside="1"' in view.value and "past the end of src" in view.value
    view.program_picker.value = 0  # the first program: row 0 and the first element of row 1
    assert repr(view) == "MemoryAccessView(copy_rows, grid (2,), program 0, tensors src, dst)"
    assert view.value.count('class="pkv-ma-load"') == 5 and 'data-outside="0"' in view.value
    assert "op 0: load 5 elements, src[0, 0] .. src[1, 0]" in view.value
    assert [w.description for w in view.controls] == ["program"]
    with pytest.raises(ValueError, match=r"program 5 is not in the grid \(2, 1, 1\)"):
        _view(log, program=5)


def test_the_view_fits_a_1000px_column() -> None:
    big, wide = torch.zeros(5000), torch.zeros(300, 700)
    with record_accesses(named={"big": big, "wide": wide, "deep": torch.zeros(40, 8, 2, 16)}) as log:
        sum_into_first[(3,)](wide, big, BLOCK=128)
        copy_rows[(1,)](torch.ones(1, 4), torch.zeros(1, 4), 4, 4, BLOCK=4)
    view = _view(log, launch=0)
    widths = [int(w) for w in re.findall(r'<svg class="pkv-ma-grid"[^>]* width="(\d+)"', view.value)]
    assert len(widths) == 3 and max(widths) <= 960
    assert "merged 4 x 4 to fit" in view.value and "a cell = deep[i, j, :, :] (32 elements)" in view.value
    assert [w.description for w in view.controls] == ["launch", "program"]
    view.launch_picker.value = 1
    assert repr(view).startswith("MemoryAccessView(copy_rows, grid (1,), all programs")
