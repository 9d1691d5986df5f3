"""benchmarks/speculative.py --smoke: the H200 benchmark's whole path on the CPU (tiny, float32), in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_speculates_and_keeps_greedy_outputs(tmp_path: Path) -> None:
    """Every (batch, k) row is measured; k > 0 engines propose drafts; in float32 their greedy outputs equal
    k = 0's (the benchmark's own check, which the H200 run reports in bf16)."""
    out = tmp_path / "speculative.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/speculative.py", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (model,) = json.loads(out.read_text())["models"]
    rows = {(r["batch"], r["k"]): r for r in model["rows"]}
    assert sorted(rows) == [(b, k) for b in (1, 4) for k in (0, 2, 4)], model["rows"]
    for (_, k), row in rows.items():
        assert (row["num_draft_tokens"] > 0) == (k > 0), row
        assert 0 <= row["num_accepted_tokens"] <= row["num_draft_tokens"]
        if k:
            assert row["identical_outputs"], row
    assert {b: len(c["rounds"]) for b, c in model["calibration"].items()} == {"1": 2, "4": 2}  # per batch size
    assert "identical to k=0" in done.stdout  # the table was printed
