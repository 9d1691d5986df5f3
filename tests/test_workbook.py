"""`pagedkv workbook`: a student's notebooks and their saved outputs are never replaced without
--force, nothing is written through a symbolic link, and a notebook that fails is one line while
the others still run. The shipped notebooks are stood in for by tiny ones (a real kernel runs them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedkv import workbook
from pagedkv.__main__ import main as cli

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")


def write_notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[Path, Path]:
    """Two notebooks, the second failing in its second cell (IPython colours the traceback), and a trace."""
    src = tmp_path / "shipped"
    (src / "traces").mkdir(parents=True)
    files = {
        Path("notebooks/00_ok.ipynb"): write_notebook(src / "00_ok.ipynb", "print(6 * 7)"),
        Path("notebooks/01_fails.ipynb"): write_notebook(src / "01_fails.ipynb", "x = 1",
                                                         "raise ValueError(f'boom {x}')", "print('never')"),
        Path("notebooks/traces/t.json"): src / "traces" / "t.json",
    }
    files[Path("notebooks/traces/t.json")].write_text("{}")
    monkeypatch.setattr(workbook, "shipped_files", lambda: files)
    return files


def test_failing_notebook_is_one_line_and_the_others_run(tmp_path: Path, shipped: dict[Path, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the first failure aborted the run with a raw CellExecutionError full of ANSI codes, and a
    second run executed the saved notebooks again, replacing their outputs."""
    dest = tmp_path / "wb"
    with pytest.raises(SystemExit) as exited:
        cli(["workbook", str(dest), "--execute"])
    out, err = capsys.readouterr()
    assert exited.value.code == 1
    assert err.splitlines() == [
        "pagedkv: error: notebook 01_fails.ipynb failed: cell 1 raised ValueError: boom 1 (not saved)",
        "pagedkv: error: 1 notebook(s) failed: 01_fails.ipynb",
    ]
    assert "ran  00_ok.ipynb in " in out
    ran = nbformat.read(dest / "notebooks/00_ok.ipynb", as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42\n"  # saved with its outputs
    assert (dest / "notebooks/01_fails.ipynb").read_bytes() == shipped[Path("notebooks/01_fails.ipynb")].read_bytes()

    # Again: the executed (so now different) notebook keeps its outputs; the unsaved one runs again.
    saved = (dest / "notebooks/00_ok.ipynb").read_bytes()
    with pytest.raises(SystemExit):
        cli(["workbook", str(dest), "--execute"])
    out, err = capsys.readouterr()
    assert "skip 00_ok.ipynb (your copy: its saved outputs are kept; --force replaces and runs it)" in out
    assert "00_ok.ipynb in " not in out
    assert (dest / "notebooks/00_ok.ipynb").read_bytes() == saved
    assert "notebook 01_fails.ipynb failed" in err


def test_symbolic_links_are_never_written_through(tmp_path: Path, shipped: dict[Path, Path]) -> None:
    """Before, a link planted where a notebook goes had its target overwritten (with --force, or
    always when dangling)."""
    dest = tmp_path / "wb"
    (dest / "notebooks").mkdir(parents=True)
    target, missing = tmp_path / "target.txt", tmp_path / "missing.txt"
    target.write_text("not yours")
    (dest / "notebooks/00_ok.ipynb").symlink_to(target)
    (dest / "notebooks/01_fails.ipynb").symlink_to(missing)  # dangling

    report = workbook.copy_workbook(dest)
    assert report.links == [Path("notebooks/00_ok.ipynb"), Path("notebooks/01_fails.ipynb")]
    assert target.read_text() == "not yours" and not missing.exists()

    report = workbook.copy_workbook(dest, force=True)
    assert {Path("notebooks/00_ok.ipynb"), Path("notebooks/01_fails.ipynb")} <= set(report.copied)
    assert target.read_text() == "not yours" and not missing.exists()
    for rel in ("notebooks/00_ok.ipynb", "notebooks/01_fails.ipynb"):  # the links themselves were replaced
        assert not (dest / rel).is_symlink() and (dest / rel).read_bytes() == shipped[Path(rel)].read_bytes()
    assert not [p for p in (dest / "notebooks").iterdir() if p.name.endswith(".tmp")]


def test_a_linked_folder_is_refused_naming_it(tmp_path: Path, shipped: dict[Path, Path]) -> None:
    dest, elsewhere = tmp_path / "wb", tmp_path / "elsewhere"
    (dest / "notebooks").mkdir(parents=True)
    elsewhere.mkdir()
    (dest / "notebooks/traces").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=f"^{dest / 'notebooks/traces'} is a symbolic link: "):
        workbook.copy_workbook(dest, force=True)
    assert list(elsewhere.iterdir()) == []


def test_a_file_as_the_folder_is_one_line(tmp_path: Path, shipped: dict[Path, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a FileExistsError traceback."""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(SystemExit) as exited:
        cli(["workbook", str(path), "--execute"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pagedkv: error: {path} is a file, not a folder: give the folder to copy the workbook into (it is made if "
        "missing)."]
    assert path.read_text() == "mine"


@pytest.mark.parametrize("uid", [0, 1000])
def test_lab_as_root_passes_allow_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uid: int) -> None:
    """Jupyter refuses to start as root without --allow-root (a container's default user)."""
    labapp = pytest.importorskip("jupyterlab.labapp")
    argvs: list[list[str]] = []
    monkeypatch.setattr(labapp, "main", lambda argv: argvs.append(argv) or 0)
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.chdir(tmp_path)  # open_lab changes into the workbook: undone after the test
    with pytest.raises(SystemExit):
        workbook.open_lab(tmp_path)
    assert argvs == [["notebooks/00_start_here.ipynb", *(["--allow-root"] if uid == 0 else [])]]
