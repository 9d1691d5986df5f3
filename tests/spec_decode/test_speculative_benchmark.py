"""benchmarks/speculative.py --smoke: the H200 benchmark's whole path on the CPU (tiny, float32), in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import smoke_run


@pytest.mark.slow
def test_smoke_run_speculates_and_keeps_greedy_outputs(tmp_path: Path) -> None:
    """Every (batch, k) row is measured; k > 0 engines propose drafts; in float32 their greedy outputs equal
    k = 0's (the benchmark's own check, which the H200 run reports in bf16)."""
    result = smoke_run("speculative.py", tmp_path / "speculative.json")
    (model,) = result["models"]
    # Each k > 0 engine is timed with the k = 0 engine on the prompts calibrated on it.
    rows = {(r["batch"], r["k"], r["calibrated_on_k"]): r for r in model["rows"]}
    assert len(rows) == len(model["rows"])
    assert sorted(rows) == sorted((b, k, c) for b in (1, 4) for c in (2, 4) for k in (0, c)), model["rows"]
    for (_, k, _), row in rows.items():
        assert (row["num_draft_tokens"] > 0) == (k > 0), row
        assert 0 <= row["num_accepted_tokens"] <= row["num_draft_tokens"]
        if k:
            assert row["identical_outputs"], row
    rounds = {key: len(c["rounds"]) for key, c in model["calibration"].items()}  # per k and batch size
    assert rounds == {f"k={k} batch={b}": 2 for k in (2, 4) for b in (1, 4)}
    assert "identical to k=0" in result["stdout"]  # the table was printed
