"""The workbook as a student sees it: JupyterLab in a real Chromium, notebook 02 run from the menu.

Starts JupyterLab on a free loopback port in a fresh copy of `notebooks/`, opens
`02_paged_kv_cache.ipynb` (its copy gets one more cell: a StepPlayer over ForwardContextView and
AttentionGroupsView, so every trace view is drawn), clears the saved outputs, runs all cells, then
checks that the StepPlayer's BlockTableView drew one cell per KV cache block, that moving the
slider with the keyboard redraws the views and the step label together, that SlotMappingView's
page slider reaches the last tokens of a prefill, and, in the light and in the dark theme, that
every text in the widgets has a WCAG contrast of at least 4.5:1 against what is drawn under it,
the "written this step" outlines at least 3:1, and free blocks take the page's background.
Screenshots go to `tests/artifacts/`.

Needs Debian's `chromium` (`apt-get install -y chromium`) and the `playwright` Python package;
skipped with the reason when either is missing. Never `playwright install`: no downloads here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
NOTEBOOK = "02_paged_kv_cache.ipynb"
EXTRA_CELL = (  # appended to the test's copy of the notebook: the views notebook 02 does not draw
    "from pagedkv.widgets import AttentionGroupsView, ForwardContextView\n"
    "StepPlayer(trace, [ForwardContextView(trace), AttentionGroupsView(trace)])"
)
VIEWS = ".pkv-block-table, .pkv-slot-mapping, .pkv-forward-context, .pkv-attention-groups"
CONTRAST_JS = (Path(__file__).parent / "contrast.js").read_text()
NUM_KV_BLOCKS = 32  # the engine of notebook 02's StepPlayer: LLM("tiny", num_kv_blocks=32, ...)
STEPS = 20  # its generate() runs 20 steps (max_tokens=20, ignore_eos=True)
KERNEL_READY_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, process: subprocess.Popen[bytes], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout_s} s")


@contextlib.contextmanager
def serve_lab(tmp: Path) -> Iterator[tuple[str, str, Path]]:
    """JupyterLab on a free loopback port serving a fresh copy of `notebooks/` in `tmp` (which must
    not exist yet): yields (base URL, token, the copy's directory)."""
    root = tmp / "work"
    shutil.copytree(REPO / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    config_dir = tmp / "config"
    (config_dir / "labconfig").mkdir(parents=True)
    # The "Jupyter news" pop-up would cover the notebook.
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    log = (tmp / "jupyterlab.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
            f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(f"{base}/api/status?token={token}", process)
        yield base, token, root
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL and token ("base|token") of a JupyterLab serving a fresh copy of the notebooks."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    nbformat = pytest.importorskip("nbformat")
    with serve_lab(tmp_path_factory.mktemp("jupyterlab") / "lab") as (base, token, root):
        nb = nbformat.read(root / NOTEBOOK, as_version=4)  # read when opened: editing it now is in time
        nb.cells.append(nbformat.v4.new_code_cell(EXTRA_CELL))
        nbformat.write(nb, root / NOTEBOOK)
        yield f"{base}|{token}"


def test_notebook_02_widgets_draw_and_redraw(lab: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    base, token = lab.split("|")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 2400})
        try:
            page.goto(f"{base}/doc/tree/{NOTEBOOK}?token={token}")
            # The idle indicator can show before the kernel's websocket is up, and cells run then are
            # lost: wait until the notebook's own kernel connection says connected and idle.
            page.wait_for_function(KERNEL_READY_JS, timeout=90_000)
            # Saved outputs hold widget state from the last nbclient run: clear them so every
            # widget checked below was drawn by this run.
            page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            # The appended last cell draws once everything above ran.
            extra = page.locator(".pkv-step-player").last
            expect(extra.locator(".pkv-forward-context")).to_be_attached(timeout=180_000)
            expect(extra.locator(".pkv-attention-groups")).to_be_attached()

            live = page.locator(".pkv-block-table").first
            expect(live).to_have_attribute("data-step", str(STEPS))  # redrawn after every step

            player = page.locator(".pkv-step-player").first
            table = player.locator(".pkv-block-table")
            slots = player.locator(".pkv-slot-mapping")
            label = player.locator(".pkv-step-label")
            expect(table.locator(".pkv-block")).to_have_count(NUM_KV_BLOCKS)
            expect(table).to_have_attribute("data-step", "1")
            expect(label).to_have_attribute("data-step", "1")
            expect(table.locator('.pkv-block[data-state="null"]')).to_have_count(1)
            used_at_step_1 = table.locator('.pkv-block[data-state="used"]').count()
            assert used_at_step_1 > 0

            # Step 1 prefills three prompts: more tokens than one page. Page to the last one.
            pages = int(slots.get_attribute("data-pages"))
            assert pages > 1
            pager = player.locator(".pkv-token-pager .noUi-handle")
            pager.focus()
            for _ in range(pages - 1):
                pager.press("ArrowRight")
            expect(slots).not_to_have_attribute("data-first-token", "0")
            expect(slots).to_contain_text(f"(page {pages} of {pages})")

            # Move the step slider with the keyboard, as a student would; the kernel redraws the views.
            handle = player.locator(".pkv-step-slider .noUi-handle")
            handle.focus()
            for _ in range(10):
                handle.press("ArrowRight")
            expect(table).to_have_attribute("data-step", "11")
            expect(slots).to_have_attribute("data-step", "11")
            expect(label).to_have_attribute("data-step", "11")
            expect(table.locator(".pkv-block")).to_have_count(NUM_KV_BLOCKS)
            assert table.locator('.pkv-block[data-state="used"]').count() > used_at_step_1  # rows grew

            for theme, light in (("JupyterLab Light", "true"), ("JupyterLab Dark", "false")):
                page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: '{theme}'}})")
                page.wait_for_function(f"document.body.dataset.jpThemeLight === '{light}'", timeout=30_000)
                page.wait_for_timeout(500)  # the theme's stylesheet applies after the attribute
                name = theme.split()[-1].lower()
                for i, widget in enumerate((player, extra)):
                    widget.scroll_into_view_if_needed()
                    widget.screenshot(path=str(ARTIFACTS / f"02_{name}_player{i}.png"))
                    report = widget.evaluate(CONTRAST_JS, VIEWS)
                    assert report["texts"] > 20, report  # the check looked at the views' text
                    assert not report["low_text"], f"{theme}: text below 4.5:1: {report['low_text'][:5]}"
                    assert not report["low_outline"], f"{theme}: outlines below 3:1: {report['low_outline'][:5]}"
                    assert not report["free_not_background"], f"{theme}: {report['free_not_background'][:5]}"
        except AssertionError:
            page.screenshot(path=str(ARTIFACTS / "02_failure.png"))  # what the page showed when it failed
            raise
        finally:
            page.screenshot(path=str(ARTIFACTS / "02_page.png"))
            browser.close()
