"""The decode kernel as Triton compiles it for the H200 (sm_90), checked on this CPU machine:
benchmarks/compile_report.py compiles it with Triton's own ptxas, no GPU needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend")
    out = tmp_path_factory.mktemp("compile") / "report.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/compile_report.py", "--json", str(out)],  # the default tiles
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {row["config"].split(":")[0]: row for row in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_tiles_keep_4_programs_per_sm_and_wide_copies(rows: dict[str, dict], cache: str) -> None:
    """Before: an fp8 V tile cast where the dot reads it was staged as bytes and gathered byte by byte
    (triton 3.6: 256 ld.shared.b8 in the code, 8-byte copies, 168 registers: 3 programs per SM)."""
    row = rows[cache]
    assert row["shared_byte_loads"] == 0 and row["copies_under_16B"] == 0, row
    assert row["copies_16B"] > 0 and row["ldmatrix"] > 0, row
    assert row["registers"] <= 128 and row["spill_bytes"] == 0 and row["programs_per_sm"] == 4, row


def test_prefill_tiles_do_not_spill_and_tma_tiles_copy_boxes(tmp_path: Path) -> None:
    """The long-prefill tiles (128 rows x 128 keys, 8 warps, 3 stages) read one page-table entry per
    page: with one per key they spilled (36 bytes, triton 3.6). With pages of 128 the K/V tiles are
    TMA copies, no cp.async copy of theirs left. (A subprocess: the report turns the interpreter off.)"""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend")
    out = tmp_path / "report.json"
    configs = ["prefill:128:128:8:3", "prefill-tma:128:128:8:3"]
    done = subprocess.run(
        [sys.executable, "benchmarks/compile_report.py", *configs, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    gathered, boxes = json.loads(out.read_text())["rows"]
    assert gathered["spill_bytes"] == 0 and gathered["wgmma"] > 0 and gathered["copies_16B"] > 0, gathered
    assert boxes["tma_copies"] > 0 and boxes["copies_16B"] == 0 and boxes["spill_bytes"] == 0, boxes
