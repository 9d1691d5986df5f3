"""The command `pagedkv workbook` tells a user to run next works in their shell: `pagedkv` only where
that name finds this installation (a venv that is not activated has it only by its full path)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import pagedkv.__main__ as cli_module

SCRIPT = Path(sys.executable).parent / "pagedkv"


@pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no pagedkv script beside {sys.executable} (not pip-installed)")
def test_the_hint_names_a_command_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, it always said `pagedkv workbook ... --lab`: "command not found" after the quick start."""
    monkeypatch.setattr(shutil, "which", lambda name: None)  # the venv is not activated
    assert cli_module._command() == str(SCRIPT)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/pagedkv")  # another installation first on PATH
    assert cli_module._command() == str(SCRIPT)
    monkeypatch.setattr(shutil, "which", lambda name: str(SCRIPT))  # activated
    assert cli_module._command() == "pagedkv"
