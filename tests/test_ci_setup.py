"""`.ci/setup` names the Python version it needs before doing anything else."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_copy(tmp_path: Path) -> Path:
    """.ci/setup alone in an empty tree: whatever it runs cannot touch the repository's .venv."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "setup", tmp_path / ".ci" / "setup")
    return tmp_path / ".ci" / "setup"


def fake_python(folder: Path, version: str) -> Path:
    """An interpreter that answers only the version question, as a Python `version` would; any other
    command (making a venv) fails loudly, so the test sees whether setup stopped before it."""
    path = folder / f"python{version}"
    path.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *version_info*) echo {version}; exit 0;; esac\n'
        'echo "fake python: unexpected call: $*" >&2; exit 3\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("version", ["3.10", "3.9", "2.7"])
def test_an_old_python_is_named(setup_copy: Path, tmp_path: Path, version: str) -> None:
    """Before, 3.10 went on to make the venv and failed in pip, on an unrelated-looking error."""
    python = fake_python(tmp_path, version)
    done = subprocess.run(
        ["bash", str(setup_copy)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)}, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr == (
        f".ci/setup: error: {python} is Python {version}; pagedkv needs Python >= 3.11 (3.11, 3.12 and 3.13 "
        "work). Install one, then: PYTHON=python3.12 bash .ci/setup\n"
    )
    assert not (setup_copy.parents[1] / ".venv").exists()


def test_a_missing_interpreter_is_named(setup_copy: Path) -> None:
    done = subprocess.run(
        ["bash", str(setup_copy)], env={"PATH": "/usr/bin:/bin", "PYTHON": "python3.99"}, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.startswith(".ci/setup: error: python3.99 is not a Python interpreter here; set PYTHON"), (
        done.stderr
    )


def test_a_supported_python_passes_the_check(setup_copy: Path, tmp_path: Path) -> None:
    """3.11 goes on to make the venv: here the fake interpreter's 'unexpected call' (exit 3) shows it got there."""
    done = subprocess.run(
        ["bash", str(setup_copy)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python(tmp_path, "3.11"))},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 3 and "unexpected call: -m venv .venv" in done.stderr, done.stderr
