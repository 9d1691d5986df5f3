"""benchmarks/host_overhead.py --smoke: the host-work benchmark's whole path on the CPU (4 requests, 2 steps)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import smoke_run


def test_smoke_run_times_pure_decode_steps_by_section(tmp_path: Path) -> None:
    """The timed steps decode all 4 requests (the script checks it); the sections it times are the
    engine's methods of this tree, none negative; no prompt token was cached."""
    result = smoke_run("host_overhead.py", tmp_path / "host_overhead.json")
    (row,) = result["rows"]
    assert row["num_requests"] == 4 and row["steps"] == 2
    assert row["cached_prompt_tokens"] == 0
    sections = row["sections_ms_median"]
    assert {"schedule", "runner inputs", "forward (stub)", "sampler"} <= set(sections), row
    assert all(ms >= 0 for ms in sections.values()), row
    assert row["step_ms_min"] > 0
    assert "host work per decode step" in result["stdout"]  # the table was printed
