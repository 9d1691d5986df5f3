"""Packaging: what pyproject.toml installs, and `pagedkv workbook` on a copy (the wheel itself: test_wheel_install.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_under_pagedkv_is_listed() -> None:
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pagedkv").rglob("__init__.py")}
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert listed - on_disk == set(mapped), "listed packages that are neither on disk nor mapped"
    assert "widgets" not in listed  # nothing claims the top-level import name


@pytest.mark.parametrize("installed", [False, True], ids=["bare-clone", "editable-install"])
def test_only_widgets_is_mapped_into_pagedkv_from_the_repository(installed: bool, tmp_path: Path) -> None:
    """`pagedkv.widgets` is the top-level widgets/ folder; tests/, benchmarks/ and notebooks/ of a clone
    are not pagedkv subpackages (they were, while pagedkv.__path__ held the repository root). The bare
    clone runs without site's .pth files, so the editable install's finder is not there to help."""
    code = (
        "import importlib, sys\nimport pagedkv\n"
        "import pagedkv.widgets.block_table as b\n"
        f"assert b.__file__ == {str(REPO / 'widgets' / 'block_table.py')!r}, b.__file__\n"
        f"assert pagedkv.__path__ == [{str(REPO / 'pagedkv')!r}], pagedkv.__path__\n"
        "for name in ('pagedkv.tests', 'pagedkv.benchmarks', 'pagedkv.notebooks.conftest'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(name + ' imports')\n"
    )
    if installed:
        command = [sys.executable, "-c", code]
    else:
        site = [p for p in sys.path if p.endswith("site-packages")]
        command = [sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {[str(REPO)]!r} + {site!r}\n" + code]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_version_comes_from_one_place() -> None:
    import pagedkv

    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pagedkv.__version__"}
    assert pagedkv.__version__.count(".") == 2


@pytest.mark.parametrize(
    ("system", "machine", "gets_triton"),
    [
        ("Linux", "x86_64", True),
        ("Linux", "aarch64", True),  # where PyPI has triton wheels
        ("Darwin", "arm64", False),
        ("Windows", "AMD64", False),
        ("Linux", "ppc64le", False),
    ],
)
def test_the_notebooks_extra_brings_triton_where_it_has_wheels(system: str, machine: str, gets_triton: bool) -> None:
    """Before, `pip install "pagedkv[notebooks]"` had no triton, and notebook 06 failed in a cell."""
    requirements = pytest.importorskip("packaging.requirements")
    triton = [
        r
        for r in map(requirements.Requirement, PYPROJECT["project"]["optional-dependencies"]["notebooks"])
        if r.name == "triton"
    ]
    assert len(triton) == 1 and triton[0].marker is not None
    env = {"platform_system": system, "platform_machine": machine, "sys_platform": system.lower(), "extra": ""}
    assert triton[0].marker.evaluate(env) == gets_triton


def test_core_imports_without_jupyter_and_widgets_name_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['ipywidgets'] = None  # as if not installed\n"
        "import pagedkv\n"
        "from pagedkv import LLM, SamplingParams\n"
        "out = LLM('tiny', num_kv_blocks=16).generate(['hi'], SamplingParams(temperature=0, max_tokens=2))\n"
        "assert len(out[0].outputs[0].token_ids) == 2\n"
        "try:\n"
        "    import pagedkv.widgets\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "pagedkv.widgets needs ipywidgets and matplotlib (ipywidgets is missing)" in done.stdout
    assert "pip install 'pagedkv[notebooks]'" in done.stdout


def test_workbook_copy_keeps_edited_notebooks_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.workbook import copy_workbook

    dest = tmp_path / "wb"
    first = copy_workbook(dest)
    shipped = {p.relative_to(REPO) for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert shipped <= set(first.copied)
    assert (dest / "benchmarks/results/attention_h200.json").is_file()  # where notebooks 06/07 look: ../benchmarks
    assert (dest / "notebooks/traces/h200_tiny-hybrid.json").is_file()
    assert not (dest / "notebooks/conftest.py").exists()

    edited = dest / "notebooks/00_start_here.ipynb"
    edited.write_text(edited.read_text().replace("Start here", "My notes"))
    again = copy_workbook(dest)
    assert again.copied == [] and again.kept == [edited.relative_to(dest)]
    assert "My notes" in edited.read_text()

    forced = copy_workbook(dest, force=True)
    assert forced.copied == [edited.relative_to(dest)]
    assert "My notes" not in edited.read_text()
