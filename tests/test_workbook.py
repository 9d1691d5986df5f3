"""`pagedkv workbook`: a student's notebooks and their saved outputs are never replaced without
--force, nothing is written through a symbolic link, `--execute` shows its progress on a terminal,
no kernel warnings, and a notebook that fails is one line naming its cell while the others still run.
The shipped notebooks are stood in for by tiny ones; one run of the command (a real kernel per notebook,
in a terminal of its own) serves every test that executes them."""

from __future__ import annotations

import fcntl
import html
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedkv import workbook
from pagedkv.__main__ import main as cli

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]


def write_notebook(path: Path, *sources: str, kernel: str = "python3") -> Path:
    """A notebook of a heading and code cells `sources`, for kernel `kernel`."""
    cells = [nbformat.v4.new_markdown_cell("# A tiny notebook"), *map(nbformat.v4.new_code_cell, sources)]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nbformat.write(nb, path)
    return path


# Two kernels of the test's own (kernelspecs found through $JUPYTER_PATH): "noisy" is ipykernel after a
# traceback on its process's stderr, as ipykernel prints one when its output thread closed before a last
# flush at shutdown; "dies" exits before it starts, saying why.
TEST_KERNELS = {
    "noisy": (
        "import sys; print('Traceback (most recent call last): noise of the kernel process', file=sys.stderr); "
        "from ipykernel.kernelapp import launch_new_instance; launch_new_instance()"
    ),
    "dies": "import sys; sys.exit('this kernel cannot start: no licence')",
}


def jupyter_path(root: Path) -> Path:
    """A $JUPYTER_PATH folder with the test kernels."""
    for name, code in TEST_KERNELS.items():
        spec = root / "jupyter" / "kernels" / name
        spec.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-c", code, "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": "python"}))
    return root / "jupyter"


def tiny_workbook(src: Path) -> dict[Path, Path]:
    """Four notebooks: the first fails in its third cell (under nbval's marker and a comment, with a two-line message),
    the second runs (in the noisy kernel), the third asks for a kernel that does not exist, the fourth for one
    that dies; and a trace."""
    (src / "traces").mkdir(parents=True)
    (src / "traces" / "t.json").write_text("{}")
    return {
        Path("notebooks/00_fails.ipynb"): write_notebook(
            src / "00_fails.ipynb",
            "x = 1",
            "\n# NBVAL_CHECK_OUTPUT\n# the answer, checked\nraise ValueError(f'boom {x}\\nline two')",
            "print('never')",
        ),
        Path("notebooks/01_ok.ipynb"): write_notebook(
            src / "01_ok.ipynb", "import sys", "print(6 * 7)", "print('to the cell', file=sys.stderr)", kernel="noisy"
        ),
        Path("notebooks/02_no_kernel.ipynb"): write_notebook(src / "02_no_kernel.ipynb", "1", kernel="no-such-kernel"),
        Path("notebooks/03_dies.ipynb"): write_notebook(src / "03_dies.ipynb", "1", kernel="dies"),
        Path("notebooks/traces/t.json"): src / "traces" / "t.json",
    }


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[Path, Path]:
    files = tiny_workbook(tmp_path / "shipped")
    monkeypatch.setattr(workbook, "shipped_files", lambda: files)
    return files


# `pagedkv workbook DIR --execute` with the tiny workbook standing in for the shipped one.
RUN_CLI = """
import json, sys
from pathlib import Path
from pagedkv import workbook
from pagedkv.__main__ import main
files = {Path(k): Path(v) for k, v in json.loads(sys.argv[1]).items()}
workbook.shipped_files = lambda: files
main(["workbook", sys.argv[2], "--execute"])
"""


@dataclass
class TerminalRun:
    code: int
    stdout: str
    terminal: str
    """All that reached stderr, a terminal 120 columns wide: the command's and the progress bars'."""
    lines: list[str]
    """`terminal` without ANSI codes, split at every carriage return and newline: each state a bar was drawn in."""


def run_in_terminal(files: dict[Path, Path], dest: Path, ctrl_c_when: Path | None = None) -> TerminalRun:
    """Run the command in a new process whose stderr is a pseudo-terminal, as a student's terminal is
    (progress bars are drawn only there). A kernel that printed to its stderr would land there too.
    `ctrl_c_when`: once this file exists, press Ctrl-C (SIGINT to the command, as a terminal sends it:
    the kernels run in sessions of their own)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "PAGEDKV_DEBUG")}
    env["PYTHONPATH"] = str(REPO)
    env["JUPYTER_PATH"] = str(jupyter_path(dest.parent))
    with subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, json.dumps({str(k): str(v) for k, v in files.items()}), str(dest)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
    ) as proc:
        os.close(follower)
        terminal = b""
        while True:
            if ctrl_c_when is not None and ctrl_c_when.exists():
                proc.send_signal(signal.SIGINT)
                ctrl_c_when = None
            if not select.select([leader], [], [], 0.2)[0]:
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            terminal += chunk
        stdout = proc.stdout.read().decode() if proc.stdout else ""
        code = proc.wait(timeout=300)
    os.close(leader)
    text = terminal.decode(errors="replace")
    lines = [line.strip() for line in re.split(r"[\r\n]", workbook.ANSI_ESCAPE.sub("", text)) if line.strip()]
    return TerminalRun(code, stdout, text, lines)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[TerminalRun, dict[Path, Path], Path]:
    """One run of `pagedkv workbook DIR --execute` on the tiny workbook, for every test below that reads it."""
    root = tmp_path_factory.mktemp("executed")
    files = tiny_workbook(root / "shipped")
    return run_in_terminal(files, root / "wb"), files, root / "wb"


def test_a_failing_notebook_names_its_cell_and_the_others_run(
    executed: tuple[TerminalRun, dict[Path, Path], Path],
) -> None:
    """Before: one line naming a 0-based cell index and the error only, no source line to find the cell by."""
    run, shipped, dest = executed
    errors = [line for line in run.lines if line.startswith("pagedkv: error:")]
    assert errors == [
        (
            "pagedkv: error: notebook 00_fails.ipynb failed at cell 3 of 4 ('# the answer, checked'): "
            "ValueError: boom 1 line two (not saved)"
        ),
        (
            "pagedkv: error: notebook 02_no_kernel.ipynb failed before its first cell: "
            "NoSuchKernel: No such kernel named no-such-kernel (not saved)"
        ),
        (
            "pagedkv: error: notebook 03_dies.ipynb failed before its first cell: "
            "RuntimeError: Kernel died before replying to kernel_info "
            "(the kernel's last words: this kernel cannot start: no licence) (not saved)"
        ),
        "pagedkv: error: 3 of 4 notebooks failed: 00_fails.ipynb, 02_no_kernel.ipynb, 03_dies.ipynb",
    ], run.terminal
    assert run.code == 1
    assert "Traceback" not in run.terminal and "Traceback" not in run.stdout
    assert "ran  01_ok.ipynb in " in run.stdout  # after the failure, the next notebook ran ...
    ran = nbformat.read(dest / "notebooks/01_ok.ipynb", as_version=4)
    assert ran.cells[2].outputs[0]["text"] == "42\n"  # ... and was saved with its outputs
    assert ran.cells[3].outputs[0]["text"] == "to the cell\n"  # a cell's stderr is its output, not the terminal's
    for failed in ("00_fails.ipynb", "02_no_kernel.ipynb", "03_dies.ipynb"):  # left as shipped
        assert (dest / "notebooks" / failed).read_bytes() == shipped[Path("notebooks") / failed].read_bytes()


def test_progress_bars_follow_the_notebooks_and_the_running_cell(
    executed: tuple[TerminalRun, dict[Path, Path], Path],
) -> None:
    """Before: nothing on the terminal while a notebook ran."""
    run, _, _ = executed
    bars = [line for line in run.lines if line.startswith(("notebooks", "cells"))]
    assert any(re.fullmatch(r"notebooks +1/4 +\|.*\| \d\d:\d\d, 01_ok\.ipynb", line) for line in bars), bars
    assert any(re.fullmatch(r"cells +2/4 +\|.*\| \d\d:\d\d, print\(6 \* 7\)", line) for line in bars), bars
    assert any(re.fullmatch(r"notebooks +4/4 +\|.*", line) for line in bars), bars
    # Printed lines go above the bars, never into one.
    assert all(line.startswith(("notebooks", "cells", "pagedkv: error:")) for line in run.lines), run.lines


def test_no_kernel_warnings_reach_the_terminal(executed: tuple[TerminalRun, dict[Path, Path], Path]) -> None:
    """Before: ipykernel >= 7 printed "[IPKernelApp] WARNING | Kernel is running over TCP without encryption ..."
    for every kernel: nbclient's kernels talked over TCP on localhost. They use Unix sockets now."""
    run, _, _ = executed
    assert "WARNING" not in run.terminal and "IPKernelApp" not in run.terminal, run.terminal
    assert "WARNING" not in run.stdout


def test_ctrl_c_stops_the_run(tmp_path: Path) -> None:
    """Before: Ctrl-C reached only the command (the kernel has a session of its own), where nbclient merely
    asked the kernel to shut down after the running cell; the cell and every other notebook ran on."""
    started = tmp_path / "started"
    files = {
        Path("notebooks/00_slow.ipynb"): write_notebook(
            tmp_path / "00_slow.ipynb",
            "import pathlib, time",
            f"pathlib.Path({str(started)!r}).touch()\ntime.sleep(120)",
        ),
        Path("notebooks/01_ok.ipynb"): write_notebook(tmp_path / "01_ok.ipynb", "print(1)"),
    }
    start = time.monotonic()
    run = run_in_terminal(files, tmp_path / "wb", ctrl_c_when=started)
    assert time.monotonic() - start < 100  # the two-minute cell was cut short
    assert run.code == 130 and "pagedkv: interrupted" in run.lines, run.terminal
    assert "01_ok" not in run.stdout and "Traceback" not in run.terminal


def test_executed_notebooks_are_not_run_again(
    tmp_path: Path, shipped: dict[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy that differs from the shipped one (run and saved, or edited) keeps its outputs: it is skipped."""
    dest = tmp_path / "wb"
    workbook.copy_workbook(dest)
    ran = dest / "notebooks/01_ok.ipynb"
    ran.write_text(ran.read_text().replace("6 * 7", "6 * 9"))
    asked: list[list[Path]] = []
    monkeypatch.setattr(workbook, "execute_workbook", lambda dest, notebooks, **_: asked.append(notebooks) or [])
    cli(["workbook", str(dest), "--execute"])
    assert "skip 01_ok.ipynb (your copy: its saved outputs are kept; --force replaces and runs it)" in (
        capsys.readouterr().out
    )
    assert asked == [[Path(f"notebooks/{name}") for name in ("00_fails.ipynb", "02_no_kernel.ipynb", "03_dies.ipynb")]]
    assert "6 * 9" in ran.read_text()


def test_a_notebook_this_machine_cannot_run_is_skipped_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without triton (no wheel for this platform), notebook 06 failed with a ValueError deep in a cell."""
    gpu = write_notebook(tmp_path / "gpu.ipynb", "1")
    triton = write_notebook(tmp_path / "triton.ipynb", "1")
    for path, meta in (
        (gpu, {"requires_gpu": True, "needs": "cpu"}),
        (triton, {"requires_gpu": False, "needs": "triton"}),
    ):
        nb = nbformat.read(path, as_version=4)
        nb.metadata["pagedkv"] = meta
        nbformat.write(nb, path)
    monkeypatch.setattr(workbook.importlib.util, "find_spec", lambda name: None)  # no triton here
    runs = list(
        workbook.execute_workbook(tmp_path, [Path("gpu.ipynb"), Path("triton.ipynb")], cuda=False, progress=False)
    )
    assert [(run.name, run.skipped) for run in runs] == [
        ("gpu.ipynb", "needs a GPU"),
        ("triton.ipynb", "needs triton, which is not installed (pip install triton, where it has a wheel)"),
    ]


def test_shipped_notebooks_read_without_warnings() -> None:
    """nbformat warns on the terminal of `pagedkv workbook --execute` about a notebook it reads with a cell
    lacking its id (seen in a wheel's run: MissingIDFieldWarning)."""
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            nbformat.validate(nbformat.read(path, as_version=4))


def test_list_and_notebook_00s_map_come_from_the_notebooks_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    """`pagedkv workbook --list` prints each notebook's metadata {"pagedkv": {"requires_gpu", "needs", "topic"}};
    notebook 00 draws its map from the same list_notebooks() (before: a table typed by hand said 07 needs a GPU)."""
    cli(["workbook", "--list"])
    lines = capsys.readouterr().out.splitlines()
    notebooks = workbook.list_notebooks()
    assert [nb.name for nb in notebooks] == sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(lines) == len(notebooks)
    for line, nb in zip(lines, notebooks, strict=True):
        meta = json.loads((REPO / "notebooks" / f"{nb.name}.ipynb").read_text())["metadata"]["pagedkv"]
        assert (nb.requires_gpu, nb.needs, nb.topic) == (meta["requires_gpu"], meta["needs"], meta["topic"])
        needs = "needs a GPU" if nb.requires_gpu else {"cpu": "CPU or GPU", "triton": "Triton"}[nb.needs]
        assert line.split() == [nb.name, *needs.split(), *nb.topic.split()], line

    start_here = json.loads((REPO / "notebooks/00_start_here.ipynb").read_text())
    [map_cell] = [c for c in start_here["cells"] if "list_notebooks()" in "".join(c["source"])]
    assert map_cell["cell_type"] == "code"
    shown = "".join(
        text
        for out in map_cell["outputs"]
        for text in [*out.get("text", []), *out.get("data", {}).get("text/html", [])]
    )
    for nb in notebooks:  # the saved map is what list_notebooks() gives now (nbval does not compare it)
        assert nb.name in shown and (nb.topic in shown or html.escape(nb.topic) in shown), (nb.name, nb.topic)


def test_symbolic_links_are_never_written_through(tmp_path: Path, shipped: dict[Path, Path]) -> None:
    """Before, a link planted where a notebook goes had its target overwritten (with --force, or
    always when dangling)."""
    dest = tmp_path / "wb"
    (dest / "notebooks").mkdir(parents=True)
    target, missing = tmp_path / "target.txt", tmp_path / "missing.txt"
    target.write_text("not yours")
    (dest / "notebooks/00_fails.ipynb").symlink_to(target)
    (dest / "notebooks/01_ok.ipynb").symlink_to(missing)  # dangling

    report = workbook.copy_workbook(dest)
    assert report.links == [Path("notebooks/00_fails.ipynb"), Path("notebooks/01_ok.ipynb")]
    assert target.read_text() == "not yours" and not missing.exists()

    report = workbook.copy_workbook(dest, force=True)
    assert {Path("notebooks/00_fails.ipynb"), Path("notebooks/01_ok.ipynb")} <= set(report.copied)
    assert target.read_text() == "not yours" and not missing.exists()
    for rel in ("notebooks/00_fails.ipynb", "notebooks/01_ok.ipynb"):  # the links themselves were replaced
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


def test_a_file_as_the_folder_is_one_line(
    tmp_path: Path, shipped: dict[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a FileExistsError traceback."""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(SystemExit) as exited:
        cli(["workbook", str(path), "--execute"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        (
            f"pagedkv: error: {path} is a file, not a folder: give the folder to copy the workbook into (it is made if "
            "missing)."
        )
    ]
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


def test_copied_notebooks_are_trusted_and_a_kept_one_is_not_resigned(
    tmp_path: Path, shipped: dict[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """JupyterLab draws a notebook's saved widgets only when it trusts it: the copies are signed in the
    Jupyter data folder, where the server looks; a copy the student edited keeps its own standing."""
    import nbformat
    from nbformat.sign import NotebookNotary

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    dest = tmp_path / "wb"
    report = workbook.copy_workbook(dest)
    notebooks = [dest / rel for rel in report.copied if rel.suffix == ".ipynb"]
    assert notebooks and all(NotebookNotary().check_signature(nbformat.read(p, as_version=4)) for p in notebooks)

    edited = nbformat.read(notebooks[0], as_version=4)
    edited.cells.append(nbformat.v4.new_code_cell("print('mine')"))
    nbformat.write(edited, notebooks[0])
    assert workbook.copy_workbook(dest).kept == [notebooks[0].relative_to(dest)]
    assert not NotebookNotary().check_signature(nbformat.read(notebooks[0], as_version=4))
