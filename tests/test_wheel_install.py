"""pagedkv as a student installs it: the wheel (not editable) in a fresh virtual environment.

Builds an sdist and a wheel with `python -m build` (and checks them with `twine check`), installs
the wheel with its `notebooks` extra (nothing else: it brings triton) and a CPU torch into a new venv,
then works from an empty folder outside the repository: imports, `LLM("tiny")`, the trained preset,
and `pagedkv workbook --execute` on the installed copy of the workbook, checking that its one unedited
notebook ran to the end, that the student's edited copies were kept, and that no kernel warning reached
the terminal. (nbval executes every notebook already.) A few minutes: most of it is installing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.readme_snippets import python_script, readme_snippets

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a fresh venv and a build: minutes
INSTALL_TORCH = REPO / ".ci" / "install-torch"  # the CPU build without a GPU, as .ci/setup installs it
VENV_GIB = 3  # the fresh venv (CPU torch, triton, jupyterlab) takes about 2.3 GiB
EXECUTED_NOTEBOOK = "02_paged_kv_cache.ipynb"  # the engine, a trace and the live views


def _run(cmd: list[str], cwd: Path, timeout: int = 900, env: dict[str, str] | None = None) -> str:
    return _run_both(cmd, cwd, timeout, env)[0]


def _run_both(cmd: list[str], cwd: Path, timeout: int = 900, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(stdout, stderr) of `cmd`, which must succeed."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout, done.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the build package (test extra) is not installed")
    out = tmp_path_factory.mktemp("dist")
    # The build runs in an isolated env and the install test in a fresh venv: both fetch packages.
    probe = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(out), "setuptools>=77"]
    if subprocess.run(probe, capture_output=True, timeout=300).returncode != 0:
        pytest.skip(
            "no package index reachable (`pip download setuptools` failed): building the wheel and "
            "installing it into a fresh venv need one"
        )
    for fetched in out.iterdir():
        fetched.unlink()
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], cwd=out)
    return out


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    pytest.importorskip("twine", reason="twine (test extra) is not installed")
    files = sorted(str(p) for p in dist.iterdir())
    assert any(f.endswith(".whl") for f in files) and any(f.endswith(".tar.gz") for f in files), files
    assert "PASSED" in _run([sys.executable, "-m", "twine", "check", "--strict", *files], cwd=dist)


def test_wheel_contents(dist: Path) -> None:
    wheel = next(dist.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("widgets/")], "a top-level widgets package would be installed"
    for needed in (
        "pagedkv/widgets/__init__.py",
        "pagedkv/notebooks/00_start_here.ipynb",
        "pagedkv/notebooks/traces/h200_tiny-hybrid.json",
        "pagedkv/benchmark_results/attention_h200.json",
        "pagedkv/models/data/tiny-pydoc/model.safetensors",
        "pagedkv/workbook.py",
    ):
        assert needed in names, needed
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    import pagedkv

    assert f"Version: {pagedkv.__version__}" in metadata
    for extra in ("notebooks", "triton", "test", "flash-attn"):
        assert f"Provides-Extra: {extra}" in metadata, extra
    assert "License-Expression: Apache-2.0" in metadata


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the wheel installed as a student installs it, `pip install
    "pagedkv[notebooks]"` (no triton extra, no `ipykernel install`), after a CPU torch where no GPU is
    visible; shared by this module's tests, removed afterwards: it is the largest thing the suite writes."""
    folder = tmp_path_factory.mktemp("wheel-venv")
    free_gib = shutil.disk_usage(folder).free / 2**30
    if free_gib < VENV_GIB:
        pytest.skip(f"{free_gib:.1f} GiB free under {folder}; a fresh venv with torch needs about {VENV_GIB} GiB")
    venv = folder / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=folder)
    python = str(venv / "bin" / "python")
    _run(["bash", str(INSTALL_TORCH), python], cwd=folder)
    _run([python, "-m", "pip", "install", "-q", f"{next(dist.glob('*.whl'))}[notebooks]"], cwd=folder)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


def _student_env() -> dict[str, str]:
    """The environment of a student's shell: nothing of this test run's (no PYTHONPATH into the clone)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "DISPLAY")}


def test_installed_wheel_runs_the_engine_and_the_workbook(venv: Path, tmp_path: Path) -> None:
    """What a student types after the install: Python, then `pagedkv workbook`, by its path, from an
    empty folder (the venv not activated)."""
    python = str(venv / "bin" / "python")
    # The notebooks extra brought triton (where it has wheels: Linux x86_64 / aarch64), and kept the CPU torch.
    versions = (
        "import importlib.metadata as m, platform, torch\n"
        "print(m.version('torch'), m.version('triton'), platform.machine(), torch.cuda.is_available())"
    )
    installed = _run([python, "-c", versions], cwd=tmp_path).split()
    torch_version, triton_version, machine, cuda = installed
    assert triton_version.startswith("3."), installed
    if cuda == "False" and machine == "x86_64":
        assert torch_version.endswith("+cpu"), installed  # not replaced by the multi-GB CUDA build

    student = tmp_path / "my-project"  # an empty folder outside the repository
    student.mkdir()
    env = _student_env()
    code = (
        "import importlib.util, pagedkv\n"
        "from pagedkv import LLM, SamplingParams\n"
        "from pagedkv.widgets import BlockTableView, StepPlayer\n"
        "assert '/site-packages/pagedkv/' in pagedkv.__file__, pagedkv.__file__\n"
        "assert importlib.util.find_spec('widgets') is None  # no top-level name claimed\n"
        "greedy = SamplingParams(temperature=0, max_tokens=24)\n"
        "print(LLM('tiny', num_kv_blocks=16).generate(['hi'], greedy)[0].outputs[0].token_ids)\n"
        "print(repr(LLM('tiny-pydoc').generate(['A function definition'], greedy)[0].outputs[0].text))\n"
    )
    out = _run([python, "-c", code], cwd=student, env=env)
    assert "is an executable" in out, out  # the shipped trained weights, read as text

    pagedkv = str(venv / "bin" / "pagedkv")
    listing = _run([pagedkv, "workbook", "--list"], cwd=student, env=env)
    assert "00_start_here" in listing and "09_serving_end_to_end" in listing
    # nbval runs every notebook already; here one runs as a student runs it. The others are edited
    # copies, which `pagedkv workbook` keeps and skips (so this also checks that it never overwrites them).
    shipped = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    edited = {
        p.name: p.read_text().replace(
            '"cells": [',
            '"cells": [{"cell_type": "markdown", "id": "mine", "metadata": {}, "source": ["my notes"]}, ',
            1,
        )
        for p in shipped
        if p.name != EXECUTED_NOTEBOOK
    }
    copies = student / "pagedkv-workbook" / "notebooks"
    copies.mkdir(parents=True)
    for name, text in edited.items():
        (copies / name).write_text(text)
    ran, stderr = _run_both([pagedkv, "workbook", "--execute"], cwd=student, env=env, timeout=1500)
    assert "warning" not in stderr.lower(), stderr  # before: one "[IPKernelApp] WARNING" per notebook
    assert sorted(p.name for p in copies.glob("[0-9][0-9]_*.ipynb")) == [p.name for p in shipped], ran
    for name, text in edited.items():
        assert f"skip {name} (your copy" in ran and (copies / name).read_text() == text, ran
    assert f"ran  {EXECUTED_NOTEBOOK}" in ran, ran
    cells = [c for c in json.loads((copies / EXECUTED_NOTEBOOK).read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in cells), f"{EXECUTED_NOTEBOOK}: not every code cell ran"
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{EXECUTED_NOTEBOOK}: {errors[0]['ename']}: {errors[0]['evalue']}"


def test_every_readme_snippet_runs_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    """The README's python blocks (in order, as one script) and bash blocks (each under `bash -e`, with
    the venv's bin first on PATH: activated), run from an empty folder outside the repository. Blocks
    marked `<!-- skip-test: REASON -->` are left out (tests/readme_snippets.py has the convention)."""
    snippets = readme_snippets()
    student = tmp_path / "readme-reader"
    student.mkdir()
    env = {**_student_env(), "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    script = student / "readme.py"
    script.write_text(python_script(snippets))
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(script)], cwd=student, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"the README's python blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for s in snippets:
        if s.language != "bash" or s.skip is not None:
            continue
        done = subprocess.run(
            ["bash", "-e", "-c", s.code], cwd=student, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == s.exit_code, (
            f"README.md line {s.line}: exit {done.returncode}, not {s.exit_code}:\n{s.code}\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
        assert "pagedkv: error" not in done.stderr, f"README.md line {s.line}:\n{done.stderr[-2000:]}"
    skipped = [f"line {s.line}: {s.skip}" for s in snippets if s.skip is not None]
    print("README blocks not run:", *skipped, sep="\n  ")
