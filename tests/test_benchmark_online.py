"""benchmarks/online.py end to end on the CPU: a tiny W2 sent at a rate and all at once to a real
`pagedkv serve` subprocess, every response checked for its full token count by the script, and the
JSON it writes read back (its numbers are timings: only their presence and sign are asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.conftest import needs_server_packages

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_online_benchmark_runs_and_loses_nothing(tmp_path: Path) -> None:
    needs_server_packages()
    out = tmp_path / "online.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "online.py"), "--model", "tiny", "--num-requests", "6"]
    command += ["--max-tokens", "5", "--rates", "50", "inf", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["offline_output_tokens_per_s"] > 0
    assert [row["rate"] for row in result["online"]] == [50.0, "inf"]
    for row in result["online"]:
        assert row["requests"] == 6 and row["errors"] == 0  # every response carried its 5 tokens
        assert row["output_tokens_per_s"] > 0 and 0 < row["ttft_s"]["p50"] <= row["latency_s"]["p99"]
    assert result["saturation_over_offline"] > 0
    assert "server at saturation / offline generate" in done.stdout
