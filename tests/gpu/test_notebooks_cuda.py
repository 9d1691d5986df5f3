"""Every notebook runs top to bottom on a GPU (CI runs them on the CPU through nbval).

The GPU machine has no Jupyter server, so the code cells run in one IPython shell per notebook,
in order, from the notebooks folder, the way a kernel would run them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_gpu(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shell_module = pytest.importorskip("IPython.core.interactiveshell", reason="IPython is not installed")
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(path.parent)
    shell = shell_module.InteractiveShell.instance()
    try:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            result = shell.run_cell("".join(cell["source"]), silent=True)
            assert result.success, (
                f"{path.name} cell {i} failed on {torch.cuda.get_device_name()}: {result.error_in_exec!r}"
            )
    finally:
        shell_module.InteractiveShell.clear_instance()
