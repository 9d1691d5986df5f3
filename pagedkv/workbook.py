"""The workbook: the notebooks that ship with pagedkv, copied to where a student edits and runs them.

    pagedkv workbook [DIR]        copy into DIR (default ./pagedkv-workbook), then open JupyterLab
                                  there, or execute every notebook when there is no display
    pagedkv workbook --list       the notebooks, and which need a GPU

DIR gets the repository's layout, so the notebooks' relative paths work as they do in a clone:

    DIR/notebooks/NN_topic.ipynb
    DIR/notebooks/traces/*.json        a trace recorded on an H200 (`StepTrace.load` replays it)
    DIR/benchmarks/results/*.json      the H200 numbers that notebooks 06, 07 and 08 plot

Where the files come from: an installed wheel holds them as package data (`pagedkv/notebooks/`,
`pagedkv/benchmark_results/`, mapped in pyproject.toml); a clone has them at its top level.
A file already in DIR that differs from the shipped one (a student's edits, saved outputs) is
kept unless `force` is set.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = Path("pagedkv-workbook")


def shipped_dirs() -> tuple[Path, Path]:
    """(notebooks, benchmark results) as this installation has them."""
    package = Path(__file__).resolve().parent
    if (package / "notebooks").is_dir():  # an installed wheel: package data
        return package / "notebooks", package / "benchmark_results"
    root = package.parent  # a clone (editable install, or PYTHONPATH)
    return root / "notebooks", root / "benchmarks" / "results"


def shipped_files() -> dict[Path, Path]:
    """Destination path relative to DIR -> the shipped file."""
    notebooks, results = shipped_dirs()
    files = {Path("notebooks") / p.relative_to(notebooks): p
             for p in [*notebooks.glob("[0-9][0-9]_*.ipynb"), *notebooks.glob("traces/*.json")]}
    files.update({Path("benchmarks/results") / p.name: p for p in results.glob("*.json")})
    if not any(dest.suffix == ".ipynb" for dest in files):
        raise FileNotFoundError(f"No notebooks found in {notebooks}: this pagedkv installation lacks its workbook.")
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class NotebookInfo:
    name: str
    title: str
    """The notebook's first heading."""
    requires_gpu: bool
    """Its metadata says {"pagedkv": {"requires_gpu": true}}: skipped where no GPU is visible."""


def notebook_info(path: Path) -> NotebookInfo:
    nb = json.loads(path.read_text(encoding="utf-8"))
    title = next((line.lstrip("# ").strip() for cell in nb["cells"] if cell["cell_type"] == "markdown"
                  for line in "".join(cell["source"]).splitlines() if line.startswith("#")), path.stem)
    return NotebookInfo(path.name, title, bool(nb.get("metadata", {}).get("pagedkv", {}).get("requires_gpu")))


def list_notebooks() -> list[NotebookInfo]:
    return [notebook_info(src) for dest, src in shipped_files().items() if dest.suffix == ".ipynb"]


@dataclass
class CopyReport:
    copied: list[Path] = field(default_factory=list)
    """New in DIR, or replaced with `force`."""
    unchanged: list[Path] = field(default_factory=list)
    """Already in DIR, equal to the shipped file."""
    kept: list[Path] = field(default_factory=list)
    """Already in DIR and different (edited or run): left as they are."""


def copy_workbook(dest_dir: Path, *, force: bool = False) -> CopyReport:
    """Copy the shipped files into `dest_dir`, never over a file that differs unless `force`."""
    report = CopyReport()
    for rel, src in shipped_files().items():
        dest = dest_dir / rel
        if dest.exists() and filecmp.cmp(src, dest, shallow=False):
            report.unchanged.append(rel)
        elif dest.exists() and not force:
            report.kept.append(rel)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            report.copied.append(rel)
    return report


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY")) or sys.platform in ("darwin", "win32")


def open_lab(dest_dir: Path) -> None:
    """JupyterLab in `dest_dir`, on the first notebook (does not return)."""
    from jupyterlab.labapp import main as lab

    os.chdir(dest_dir)
    sys.exit(lab([str(Path("notebooks") / "00_start_here.ipynb")]))


def execute_workbook(dest_dir: Path, *, cuda: bool) -> list[tuple[str, float | None]]:
    """Run every notebook in `dest_dir/notebooks` top to bottom and save it with its outputs.

    Returns (name, seconds), seconds None for a notebook skipped because it needs a GPU.
    """
    import nbformat
    from nbclient import NotebookClient

    notebooks = dest_dir / "notebooks"
    # Without a GPU, notebook 06's Triton kernels need Triton's interpreter: set it for the kernels.
    kernel_env = {} if cuda else {"env": {**os.environ, "TRITON_INTERPRET": "1"}}
    ran: list[tuple[str, float | None]] = []
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if nb.metadata.get("pagedkv", {}).get("requires_gpu") and not cuda:
            ran.append((path.name, None))
            continue
        start = time.perf_counter()
        NotebookClient(nb, timeout=1200, resources={"metadata": {"path": str(notebooks)}},
                       store_widget_state=True).execute(**kernel_env)
        nbformat.write(nb, path)
        ran.append((path.name, time.perf_counter() - start))
    return ran
