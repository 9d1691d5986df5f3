"""The workbook as a student sees it: JupyterLab in a real Chromium, every notebook run from the menu.

Starts JupyterLab on a free loopback port in a fresh copy of `notebooks/` (windowing off, so every
cell is laid out and measured), then:

- `test_notebook_02_widgets_draw_and_redraw`: opens `02_paged_kv_cache.ipynb` (its copy gets one
  more cell: a StepPlayer over ForwardContextView and AttentionGroupsView, so every trace view is
  drawn), clears the saved outputs, runs all cells, then checks that the StepPlayer's BlockTableView
  drew one cell per KV cache block, that moving the slider with the keyboard redraws the views and
  the step label together, that SlotMappingView's page slider reaches the last tokens of a prefill,
  and, in the light and in the dark theme, that every text in the widgets has a WCAG contrast of at
  least 4.5:1 against what is drawn under it, the "written this step" outlines at least 3:1, and
  free blocks take the page's background.
- `test_notebook_in_both_themes[NN_x.ipynb]`, one per notebook, one at a time in the same JupyterLab:
  outputs cleared, Run All, no cell raising and none left unrun; then, in the light and in the dark
  theme at a 1280 px window with the file browser open, over every widget and every HTML output:
  text contrast >= 4.5:1 (contrast.js), and over every output (layout.js): nothing wider than its
  output area, no text cut by its box (labels, dropdowns), no printed line that wraps, figures
  drawn through show_figure showing the rendering of the theme (an image output not drawn through
  it is a failure too); and no code cell that scrolls sideways.
  Failures are listed per notebook, cell (index in the notebook, and its first line) and element.

Screenshots of every widget / HTML / image output in both themes, and one JSON report per notebook,
go to `tests/artifacts/` (git-ignored). Needs Debian's `chromium` (`apt-get install -y chromium`) and
the `playwright` Python package; skipped with the reason when either is missing. Never
`playwright install`: no downloads here.
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
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # JupyterLab and Chromium, every notebook twice: minutes
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NOTEBOOK = "02_paged_kv_cache.ipynb"
EXTRA_CELL = (  # appended to the test's copy of the notebook: the views notebook 02 does not draw
    "from pagedkv.widgets import AttentionGroupsView, ForwardContextView\n"
    "StepPlayer(trace, [ForwardContextView(trace), AttentionGroupsView(trace)])"
)
VIEWS = ".pkv-block-table, .pkv-slot-mapping, .pkv-forward-context, .pkv-attention-groups"
CONTRAST_JS = (Path(__file__).parent / "contrast.js").read_text()
LAYOUT_JS = (Path(__file__).parent / "layout.js").read_text()
NOTEBOOKS = sorted(path.name for path in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WINDOW = {"width": 1280, "height": 1000}
"""The window of the layout checks (issue 32: a 1280 px window)."""
OUTPUTS = ".jp-OutputArea-output:has(> .jupyter-widgets), " + ", ".join(
    f'.jp-OutputArea-output[data-mime-type="{mime}"]' for mime in ("text/html", "text/markdown")
)
"""Outputs whose colours the notebook chose (widgets, HTML): the contrast check's targets. Plain text
and images take the theme's colours or are checked by layout.js."""
SHOTS = OUTPUTS + ', .jp-OutputArea-output[data-mime-type^="image/"]'
RUN_TIMEOUT_S = 300
THEMES = (("JupyterLab Light", True), ("JupyterLab Dark", False))
NUM_KV_BLOCKS = 32  # the engine of notebook 02's StepPlayer: LLM("tiny", num_kv_blocks=32, ...)
STEPS = 20  # its generate() runs 20 steps (max_tokens=20, ignore_eos=True)
KERNEL_READY_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}"""
RECORD_LIVE_STEPS_JS = """() => {
    // Every step the first block table (notebook 02's live view) was drawn at, as the browser saw it.
    window.pkvLiveSteps = [];
    new MutationObserver(() => {
        const table = document.querySelector(".pkv-block-table");
        const step = table && Number(table.dataset.step);
        if (step && !window.pkvLiveSteps.includes(step)) window.pkvLiveSteps.push(step);
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""
RUN_STATE_JS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    const code = panel.content.widgets.filter((c) => c.model.type === "code");
    return {
        started: code.some((c) => c.model.executionCount !== null || c.model.executionState === "running"),
        running: code.some((c) => c.model.executionState === "running"),
        idle: !!kernel && kernel.status === "idle",
    };
}"""
CELLS_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map((c) => ({
    type: c.model.type,
    source: c.model.sharedModel.getSource(),
    count: c.model.type === "code" ? c.model.executionCount : null,
    errors: c.model.type === "code"
        ? c.model.outputs.toJSON().filter((o) => o.output_type === "error").map((o) => `${o.ename}: ${o.evalue}`)
        : [],
}))"""
WIDGET_STATE_JS = """() => {
    const cells = [...document.querySelectorAll(".jp-Cell")];
    const outs = [...document.querySelectorAll(".jp-OutputArea-output")];
    const matching = (re) => outs.filter((o) => re.test(o.textContent.trim()))
        .map((o) => cells.indexOf(o.closest(".jp-Cell")));
    return {loading: matching(/^Loading widget/), broken: matching(/^Error displaying widget/)};
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
    # Notebooks 06-08 plot the numbers recorded under ../benchmarks/results/ (relative to the notebook).
    (tmp / "benchmarks").symlink_to(REPO / "benchmarks", target_is_directory=True)
    config_dir = tmp / "config"
    (config_dir / "labconfig").mkdir(parents=True)
    # The "Jupyter news" pop-up would cover the notebook.
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    # Every cell attached and laid out (the default, contentVisibility, skips the layout of cells out
    # of view, and the checks measure every output).
    tracker = tmp / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    # A student's kernel: no TRITON_INTERPRET from CI's environment (each notebook's first cell
    # must turn the interpreter on itself), and the default minimum frame time of live views.
    outside = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDKV_MIN_FRAME_S")}
    env = {
        **outside,
        "JUPYTER_CONFIG_DIR": str(config_dir),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
    }
    log = (tmp / "jupyterlab.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
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


class Lab(NamedTuple):
    base: str
    token: str
    root: Path
    """The notebooks' copy that the lab serves."""

    def url(self, notebook: str) -> str:
        """The notebook alone in the single-document view."""
        return f"{self.base}/doc/tree/{notebook}?token={self.token}"

    def lab_url(self, notebook: str) -> str:
        """The notebook in JupyterLab as a student first sees it: the file browser open on the left
        (at a 1280 px window the notebook's output area is ~850 px wide); `reset`: no notebook of an
        earlier page reopens with it."""
        return f"{self.base}/lab/tree/{notebook}?reset&token={self.token}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A JupyterLab serving a fresh copy of the notebooks."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    nbformat = pytest.importorskip("nbformat")
    with serve_lab(tmp_path_factory.mktemp("jupyterlab") / "lab") as (base, token, root):
        nb = nbformat.read(root / NOTEBOOK, as_version=4)  # read when opened: editing it now is in time
        nb.cells.append(nbformat.v4.new_code_cell(EXTRA_CELL))
        nbformat.write(nb, root / NOTEBOOK)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        yield Lab(base, token, root)


@pytest.fixture(scope="module")
def chromium(lab: Lab) -> Iterator[Any]:
    """One headless Chromium for the module's tests (each opens its own page)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_and_run_all(page: Any, url: str, *, from_menu: bool = False, before_run: str | None = None) -> None:
    """Open a notebook, clear its saved outputs, (evaluate `before_run`,) Run All; returns once the
    run started."""
    page.goto(url)
    # The idle indicator can show before the kernel's websocket is up, and cells run then are
    # lost: wait until the notebook's own kernel connection says connected and idle.
    page.wait_for_function(KERNEL_READY_JS, timeout=90_000)
    # Saved outputs hold widget state from the last nbclient run: clear them so every
    # widget checked was drawn by this run.
    page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    if before_run:
        page.evaluate(before_run)
    if from_menu:  # as a student does
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    else:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def wait_until_run_ends(page: Any, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Until no cell runs or waits to run and the kernel is idle, for 1.5 s in a row (between two
    cells of Run All both can look idle for a moment)."""
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 3:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Run All did not finish within {timeout_s} s")
        state = page.evaluate(RUN_STATE_JS)
        calm = calm + 1 if state["started"] and state["idle"] and not state["running"] else 0
        page.wait_for_timeout(500)


def shut_down_kernel(page: Any) -> None:
    """Free the notebook's kernel (the server keeps one per notebook; 2 cores, and its memory)."""
    with contextlib.suppress(Exception):
        page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


def set_theme(page: Any, theme: str, light: bool) -> None:
    page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: '{theme}'}})")
    page.wait_for_function(f"document.body.dataset.jpThemeLight === '{str(light).lower()}'", timeout=30_000)
    page.wait_for_timeout(500)  # the theme's stylesheet applies after the attribute


def test_notebook_02_widgets_draw_and_redraw(lab: Lab, chromium: Any) -> None:
    from playwright.sync_api import expect

    page = chromium.new_page(viewport={"width": 1280, "height": 2400})
    try:
        open_and_run_all(page, lab.url(NOTEBOOK), from_menu=True, before_run=RECORD_LIVE_STEPS_JS)
        # The appended last cell draws once everything above ran.
        extra = page.locator(".pkv-step-player").last
        expect(extra.locator(".pkv-forward-context")).to_be_attached(timeout=180_000)
        expect(extra.locator(".pkv-attention-groups")).to_be_attached()

        live = page.locator(".pkv-block-table").first
        expect(live).to_have_attribute("data-step", str(STEPS))  # redrawn after every step
        # Watchable: each step's frame stayed up min_frame_s (0.25 s), so the browser drew most of
        # them (without it: steps 1 -> 9 -> 20).
        seen = page.evaluate("window.pkvLiveSteps")
        assert len(seen) >= STEPS // 2, f"the live view showed only steps {seen} of 1..{STEPS}"

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

        for theme, light in THEMES:
            set_theme(page, theme, light)
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
        shut_down_kernel(page)
        page.close()


def _first_line(source: str) -> str:
    """The first line of a cell that says what it is (not a comment, not blank), shortened."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    code = [line for line in lines if not line.startswith("#")]
    return ((code or lines or [""])[0])[:70]


def _findings(report: dict[str, Any], theme: str, cells: list[dict[str, Any]]) -> list[str]:
    """One line per failure of a contrast / layout report: theme, check, cell and element."""

    def where(item: dict[str, Any]) -> str:
        i = item.get("cell", -1)
        return f"cell {i} ({_first_line(cells[i]['source'])!r})" if 0 <= i < len(cells) else "outside a cell"

    lines = []
    for item in report.get("low_text", []):
        lines.append(
            f"{theme}: contrast {item['ratio']}:1 < 4.5 in {where(item)}: {item['text']!r} "
            f"({item['fg']} on {item['bg']})"
        )
    for key in ("low_outline", "free_not_background"):
        lines += [f"{theme}: {key} in {where(item)}: {item}" for item in report.get(key, [])]
    for key in ("overflow", "cut", "wraps", "figures", "bare_figures", "code"):
        for item in report.get(key, []):
            by = f" by {item['by_px']} px" if "by_px" in item else ""
            lines.append(f"{theme}: {key} in {where(item)}: {item['element']}: {item['what']}{by}")
    return lines


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_in_both_themes(lab: Lab, chromium: Any, notebook: str) -> None:
    """Run All, then contrast, layout and figures in the light and the dark theme (see the module docstring)."""
    stem = notebook.split("_")[0]
    page = chromium.new_page(viewport=WINDOW)
    failures: list[str] = []
    reports: dict[str, Any] = {}
    started = time.monotonic()
    try:
        open_and_run_all(page, lab.lab_url(notebook))
        wait_until_run_ends(page)
        reports["run_s"] = round(time.monotonic() - started, 1)
        cells = page.evaluate(CELLS_JS)
        for i, cell in enumerate(cells):
            failures += [f"cell {i} ({_first_line(cell['source'])!r}) raised {error[:300]}" for error in cell["errors"]]
        unrun = [i for i, c in enumerate(cells) if c["type"] == "code" and c["source"].strip() and c["count"] is None]
        if unrun:
            failures.append(f"{len(unrun)} code cells did not run (cells {unrun[:10]}): Run All stops at an error")
        with contextlib.suppress(Exception):  # widgets draw after the kernel is idle: give them a moment
            page.wait_for_function(f"({WIDGET_STATE_JS})().loading.length === 0", timeout=30_000)
        widgets = page.evaluate(WIDGET_STATE_JS)
        failures += [f"cell {i}: widget still loading after 30 s" for i in widgets["loading"]]
        failures += [f"cell {i}: Error displaying widget" for i in widgets["broken"]]
        notebook_el = page.locator(".jp-Notebook").first
        for theme, light in THEMES:
            set_theme(page, theme, light)
            name = "light" if light else "dark"
            contrast = notebook_el.evaluate(CONTRAST_JS, OUTPUTS)
            layout = notebook_el.evaluate(LAYOUT_JS, light)
            reports[name] = {"contrast": contrast, "layout": layout}
            failures += _findings(contrast, name, cells) + _findings(layout, name, cells)
            outputs = page.locator(SHOTS)
            for k in range(outputs.count()):
                output = outputs.nth(k)
                i = output.evaluate("(o) => [...document.querySelectorAll('.jp-Cell')].indexOf(o.closest('.jp-Cell'))")
                with contextlib.suppress(Exception):  # a screenshot is for looking at, not a check
                    output.screenshot(path=str(ARTIFACTS / f"{stem}_{name}_cell{i:02d}_{k}.png"), timeout=10_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"{stem}_failure.png"))
        raise
    finally:
        reports["failures"] = failures
        reports["total_s"] = round(time.monotonic() - started, 1)
        (ARTIFACTS / f"{stem}_report.json").write_text(json.dumps(reports, indent=1))
        shut_down_kernel(page)
        page.close()
    assert not failures, f"{notebook}: {len(failures)} failure(s):\n" + "\n".join(failures)
