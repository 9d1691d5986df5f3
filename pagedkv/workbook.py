"""The workbook: the notebooks that ship with pagedkv, copied to where a student edits and runs them.

    pagedkv workbook [DIR]        copy into DIR (default ./pagedkv-workbook), then open JupyterLab
                                  there, or execute every notebook when there is no display
    pagedkv workbook --list       the notebooks: what each needs (GPU, Triton), and its topic

DIR gets the repository's layout, so the notebooks' relative paths work as they do in a clone:

    DIR/notebooks/NN_topic.ipynb
    DIR/notebooks/traces/*.json        a trace recorded on an H200 (`StepTrace.load` replays it); the
                                       prefill ladder's TFLOP/s measured on an H100 (notebook 15), once run
    DIR/benchmarks/results/*.json      the H200 numbers that notebooks 06, 07 and 08 plot

Where the files come from: an installed wheel holds them as package data (`pagedkv/notebooks/`,
`pagedkv/benchmark_results/`, mapped in pyproject.toml); a clone has them at its top level.
A file already in DIR that differs from the shipped one (a student's edits, saved outputs) is
kept unless `force` is set, and is not executed again; nothing is written through a symbolic link.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import filecmp
import functools
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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
    files = {
        Path("notebooks") / p.relative_to(notebooks): p
        for p in [*notebooks.glob("[0-9][0-9]_*.ipynb"), *notebooks.glob("traces/*.json")]
    }
    files.update({Path("benchmarks/results") / p.name: p for p in results.glob("*.json")})
    if not any(dest.suffix == ".ipynb" for dest in files):
        raise FileNotFoundError(f"No notebooks found in {notebooks}: this pagedkv installation lacks its workbook.")
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class NotebookInfo:
    """One notebook of the workbook, from its metadata: {"pagedkv": {"needs": ..., "topic": ...}}.

    This is the one list of notebooks: `pagedkv workbook --list` prints it, and notebook 00's map
    is drawn from it.
    """

    name: str
    title: str
    """The notebook's first heading."""
    topic: str
    """What it covers, in a line."""
    needs: str
    """"cpu" (runs anywhere) or "triton" (Triton kernels: compiled on a GPU, interpreted on a CPU)."""
    requires_gpu: bool
    """Its metadata says {"pagedkv": {"requires_gpu": true}}: skipped where no GPU is visible."""


def notebook_info(path: Path) -> NotebookInfo:
    nb = json.loads(path.read_text(encoding="utf-8"))
    meta = nb.get("metadata", {}).get("pagedkv", {})
    title = next(
        (
            line.lstrip("# ").strip()
            for cell in nb["cells"]
            if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
            if line.startswith("#")
        ),
        path.stem,
    )
    return NotebookInfo(
        path.stem, title, meta.get("topic", title), meta.get("needs", "cpu"), bool(meta.get("requires_gpu"))
    )


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
    links: list[Path] = field(default_factory=list)
    """Symbolic links where a shipped file goes: left alone (`force` replaces the link itself)."""


def copy_workbook(dest_dir: Path, *, force: bool = False) -> CopyReport:
    """Copy the shipped files into `dest_dir`, never over a file that differs unless `force`, and
    never through a symbolic link: a file is written beside its place, then renamed onto it."""
    if dest_dir.exists() and not dest_dir.is_dir():
        raise ValueError(
            f"{dest_dir} is a file, not a folder: give the folder to copy the workbook into (it is made if missing)."
        )
    report = CopyReport()
    for rel, src in shipped_files().items():
        dest = dest_dir / rel
        for folder in reversed(rel.parents[:-1]):  # notebooks/, notebooks/traces/, ...
            if (dest_dir / folder).is_symlink():
                raise ValueError(
                    f"{dest_dir / folder} is a symbolic link: the workbook writes only into real "
                    f"folders of {dest_dir}; remove the link or choose another folder."
                )
        link = dest.is_symlink()
        if link and not force:
            report.links.append(rel)
        elif not link and dest.is_file() and filecmp.cmp(src, dest, shallow=False):
            report.unchanged.append(rel)
        elif not link and dest.exists() and not force:
            report.kept.append(rel)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            replace_file(dest, src.read_bytes())
            report.copied.append(rel)
    trust_notebooks([dest_dir / rel for rel in report.copied if rel.suffix == ".ipynb"])
    return report


def trust_notebooks(paths: list[Path]) -> None:
    """Sign the notebooks just copied as trusted, as `jupyter trust` does: JupyterLab then draws their
    saved widgets and HTML (tables, figures that follow the theme) the first time a student opens
    them, instead of hiding them until the notebook runs. Only the shipped files are signed; a copy
    the student changed is never re-signed. Nothing to do where Jupyter is not installed."""
    try:
        import nbformat
        from nbformat.sign import NotebookNotary
    except ImportError:
        return
    notary = NotebookNotary()
    for path in paths:
        notary.sign(nbformat.read(path, as_version=4))


def replace_file(dest: Path, data: bytes) -> None:
    """Write `data` to a new file beside `dest`, then rename it onto `dest`: a symbolic link at
    `dest` is replaced, not written through, and a reader never sees half a file."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("xb") as f:  # O_EXCL: fails on an existing file or link, never follows one
            f.write(data)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY")) or sys.platform in ("darwin", "win32")


def open_lab(dest_dir: Path) -> None:
    """JupyterLab in `dest_dir`, on the first notebook (does not return)."""
    from jupyterlab.labapp import main as lab

    argv = [str(Path("notebooks") / "00_start_here.ipynb")]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Jupyter refuses to run as root without it (containers)
        argv.append("--allow-root")
    os.chdir(dest_dir)
    sys.exit(lab(argv))


@dataclass(frozen=True)
class NotebookRun:
    """What executing one notebook of the workbook did."""

    name: str
    seconds: float
    """How long it ran (0 when skipped)."""
    error: str | None = None
    """Where it failed (cell number and first line) and the error, on one line; the notebook is then not saved."""
    skipped: str | None = None
    """Why it did not run: it needs a GPU, or triton, that this machine lacks."""


def skip_reason(nb: Any, *, cuda: bool) -> str | None:
    """Why notebook `nb` cannot run here, from its metadata; None if it can."""
    meta = nb.metadata.get("pagedkv", {})
    if meta.get("requires_gpu") and not cuda:
        return "needs a GPU"
    if meta.get("needs") == "triton" and importlib.util.find_spec("triton") is None:
        # pagedkv[notebooks] brings triton wherever PyPI has a wheel of it (Linux on x86_64 or aarch64).
        return "needs triton, which is not installed (pip install triton, where it has a wheel)"
    return None


def execute_workbook(
    dest_dir: Path, notebooks: list[Path], *, cuda: bool, progress: bool | None = None
) -> Iterator[NotebookRun]:
    """Run each of `notebooks` (paths relative to `dest_dir`) top to bottom in a fresh kernel, as Run All
    does in JupyterLab, and save it with its outputs; one that fails is reported and left as it was, and
    the others still run. Ctrl-C stops the run (KeyboardInterrupt).

    Two progress bars on stderr follow the run: the notebooks, and the cells of the running notebook
    (`progress` None: only on a terminal). Print between the runs with `tqdm.write`, which keeps the
    bars below the printed lines.
    """
    import nbformat
    from tqdm import tqdm

    disable = None if progress is None else not progress  # tqdm's None: off unless stderr is a terminal
    bar_format = "{desc:<9} {n_fmt:>3}/{total_fmt:<3} |{bar:20}| {elapsed}{postfix}"
    with (
        tempfile.TemporaryDirectory(prefix="pagedkv-kernels-") as sockets,
        tqdm(
            total=len(notebooks),
            desc="notebooks",
            disable=disable,
            bar_format=bar_format,
            position=0,
            dynamic_ncols=True,
        ) as notebook_bar,
        tqdm(
            total=0, desc="cells", disable=disable, bar_format=bar_format, position=1, leave=False, dynamic_ncols=True
        ) as cell_bar,
    ):
        for rel in notebooks:
            path = dest_dir / rel
            nb = nbformat.read(path, as_version=4)
            notebook_bar.set_postfix_str(path.name)
            if (reason := skip_reason(nb, cuda=cuda)) is not None:
                notebook_bar.update()
                yield NotebookRun(path.name, 0.0, skipped=reason)
                continue
            cell_bar.reset(total=len(nb.cells))
            cell_bar.set_postfix_str("", refresh=False)
            kernel_log = Path(sockets) / f"{path.stem}.log"
            with kernel_log.open("wb") as log:
                client = workbook_client()(
                    nb,
                    cell_bar,
                    log,
                    timeout=1200,
                    store_widget_state=True,
                    resources={"metadata": {"path": str(path.parent)}},
                    config=kernel_config(Path(sockets)),
                )
                start = time.perf_counter()
                try:
                    client.execute()
                except Exception as exc:  # CellExecutionError, a dead or missing kernel, a timeout: this one only
                    if client.ctrl_c:
                        raise KeyboardInterrupt from None
                    # When the kernel did not start, nbclient leaves its exit-time clean-up registered, and at
                    # exit that clean-up fails with a traceback on the terminal (its kernel manager is gone).
                    atexit.unregister(client._cleanup_kernel)
                    notebook_bar.update()
                    error = _failure(nb, client.running, exc, last_line(kernel_log))
                    yield NotebookRun(path.name, time.perf_counter() - start, error=error)
                    continue
            if client.ctrl_c:  # pressed just as the last cell finished: stop all the same
                raise KeyboardInterrupt
            replace_file(path, nbformat.writes(nb).encode("utf-8"))
            trust_notebooks([path])  # its outputs are this run's, as if the student had run it in the lab
            cell_bar.update(cell_bar.total - cell_bar.n)
            notebook_bar.update()
            yield NotebookRun(path.name, time.perf_counter() - start)


class Interrupted(Exception):
    """Ctrl-C was pressed before the cell could start: the notebook stops there."""


@functools.cache
def workbook_client() -> type:
    """nbclient's NotebookClient with what `pagedkv workbook --execute` adds (a class made on first use:
    nbclient comes with the notebooks extra, and copying or listing the workbook does without it)."""
    from nbclient import NotebookClient

    class WorkbookClient(NotebookClient):
        """Moves the cell progress bar `cell_bar` and remembers the running cell (`running`, its index).

        The kernel process writes its own stderr (not a cell's: that is the cell's output) to `kernel_log`,
        not to the terminal: ipykernel logs there, e.g. a traceback when its output thread closed before
        a last flush at shutdown, which would land between the progress bars.

        Ctrl-C stops the run, as it stops any command. The kernel runs in a session of its own, so the
        terminal's Ctrl-C reaches only this process, where nbclient's handler merely asks the kernel to
        shut down once the running cell is done, and the run went on. Here the first Ctrl-C interrupts
        the cell, as JupyterLab's stop button does, a second one kills the kernel; the notebook then
        fails, and `ctrl_c` (the number of presses) tells the caller to stop.
        """

        def __init__(self, nb: Any, cell_bar: Any, kernel_log: IO[bytes], **kwargs: Any) -> None:
            super().__init__(nb, **kwargs)
            self.cell_bar = cell_bar
            self.kernel_log = kernel_log
            self.running: int | None = None
            self.ctrl_c = 0

        async def async_start_new_kernel(self, **kwargs: Any) -> None:
            # nbclient has just put in its own SIGINT handler: replace it (it removes the handler at the end).
            with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals here (Windows, a thread)
                asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self.on_ctrl_c)
            await super().async_start_new_kernel(stderr=self.kernel_log, **kwargs)

        def on_ctrl_c(self) -> None:
            self.ctrl_c += 1
            if self.km is not None and self.km.has_kernel:
                stop = self.km.interrupt_kernel() if self.ctrl_c == 1 else self.km.shutdown_kernel(now=True)
                # nbclient types km as a (blocking) KernelManager; it makes an AsyncKernelManager, whose
                # interrupt_kernel and shutdown_kernel return coroutines.
                asyncio.ensure_future(stop)  # type: ignore[call-overload]

        async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any, **kwargs: Any) -> Any:
            if self.ctrl_c:  # pressed while the kernel started, or between two cells
                raise Interrupted
            self.running = cell_index
            self.cell_bar.update(cell_index - self.cell_bar.n)  # the cells above it are done
            self.cell_bar.set_postfix_str(first_line(cell.source, 40), refresh=True)
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    return WorkbookClient


def kernel_config(sockets: Path) -> Any:
    """Kernel settings for nbclient: talk to the kernel through Unix sockets in `sockets` (a folder only
    this user can open), not unencrypted TCP on localhost, on which ipykernel >= 7 warns on the terminal
    for every kernel ("[IPKernelApp] WARNING | Kernel is running over TCP without encryption")."""
    from traitlets.config import Config

    if os.name != "posix":  # ZeroMQ's ipc transport is Unix sockets
        return Config()
    # An absolute path: the kernel runs in the notebook's folder, and a relative one would name another socket.
    return Config({"KernelManager": {"transport": "ipc", "ip": str(sockets.resolve() / "kernel")}})


def first_line(source: str, width: int) -> str:
    """The first line of a cell's source that tells it apart, cut to `width` characters: not blank, not
    one of nbval's markers (`# NBVAL_CHECK_OUTPUT`, which many cells start with)."""
    line = next(
        (line.strip() for line in source.splitlines() if line.strip() and not line.strip().startswith("# NBVAL_")), ""
    )
    return line if len(line) <= width else line[: width - 3] + "..."


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def last_line(path: Path) -> str:
    """The last line of text file `path` that is not blank ("" if none)."""
    lines = path.read_text(errors="replace").splitlines()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _failure(nb: Any, index: int | None, exc: Exception, kernel_said: str = "") -> str:
    """One line: which cell failed (its number, counting every cell from 1, and its first line) and the error,
    without IPython's ANSI colour codes. `kernel_said`: the last line the kernel process wrote to its stderr,
    which tells why a kernel died or did not start."""
    from nbclient.exceptions import CellExecutionError

    if isinstance(exc, CellExecutionError):  # its str() is the whole traceback: the exception's name and value
        error = f"{exc.ename}: {exc.evalue}"
    else:  # a timeout, a dead kernel, one that did not start
        error = f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"
        if kernel_said:
            error += f" (the kernel's last words: {kernel_said})"
    where = (
        "before its first cell"
        if index is None
        else f"at cell {index + 1} of {len(nb.cells)} ({first_line(nb.cells[index].source, 60)!r})"
    )
    return " ".join(ANSI_ESCAPE.sub("", f"{where}: {error}").split())
