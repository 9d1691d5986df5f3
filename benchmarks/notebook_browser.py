"""How long each workbook notebook takes to run in JupyterLab, in a real Chromium, as a student runs it.

    python benchmarks/notebook_browser.py [09_serving_end_to_end.ipynb ...] [--json out.json]

Starts JupyterLab on a fresh copy of `notebooks/` (the browser test's set-up), and per notebook:
opens it, waits for its kernel, clears the saved outputs, lets the page settle, clicks Run > Run
All Cells and times until every code cell has an execution count and the kernel is idle again
(kernel start-up is not counted; `--cells` prints each code cell's share). Headless time (the
same notebook through nbclient, no browser) is printed beside it: the difference is what drawing
the widgets and plots in the page costs. Issue 10's target: notebook 09 <= 10 s on 2 CPU cores.
Needs Debian's `chromium` and the `playwright` package, like tests/browser.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.browser.test_jupyterlab import CHROMIUM, CHROMIUM_ARGS, KERNEL_READY_JS, serve_lab  # noqa: E402

SETTLE_MS = 3000
"""Wait after the kernel is ready, before Run All: the page is still loading (a student reads first)."""
PROGRESS_JS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const cells = panel.content.widgets.filter(c => c.model.type === "code");
    return {idle: panel.sessionContext.session.kernel.status === "idle",
            done: cells.map(c => c.model.executionCount !== null)};
}"""


def browser_seconds(page, base: str, token: str, notebook: str) -> tuple[float, list[float]]:
    """Seconds from Run All to the last cell done and the kernel idle; and when each code cell
    finished (seen by polling every 50 ms, so each time is late by up to that)."""
    page.goto(f"{base}/doc/tree/{notebook}?token={token}")
    page.wait_for_function(KERNEL_READY_JS, timeout=90_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    page.wait_for_timeout(SETTLE_MS)
    start = time.perf_counter()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    finished: dict[int, float] = {}
    while True:
        progress = page.evaluate(PROGRESS_JS)
        now = time.perf_counter() - start
        for i, done in enumerate(progress["done"]):
            if done:
                finished.setdefault(i, now)
        if progress["idle"] and len(finished) == len(progress["done"]):
            return now, [finished[i] for i in range(len(finished))]
        if now > 600:
            raise TimeoutError(f"{notebook}: not done after 600 s")
        page.wait_for_timeout(50)


def headless_seconds(path: Path) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", default=["09_serving_end_to_end.ipynb"])
    p.add_argument("--cells", action="store_true", help="print how long each code cell took in the browser")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not CHROMIUM.exists():
        sys.exit(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-notebook-browser-")) / "lab"
    with serve_lab(tmp) as (base, token, root), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 2400})
        for name in args.notebooks:
            total, cells = browser_seconds(page, base, token, name)
            row = {
                "notebook": name,
                "browser_s": total,
                "cells_done_at_s": cells,
                "headless_s": headless_seconds(root / name),
            }
            print(f"{name:<44}{total:8.1f} s in the browser {row['headless_s']:8.1f} s headless", flush=True)
            if args.cells:
                steps = [b - a for a, b in zip([0.0, *cells], cells)]
                print("  code cells, s each:", " ".join(f"{t:.1f}" for t in steps))
            rows.append(row)
        browser.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
