"""The README's code blocks, as a test runs them (tests/test_wheel_install.py, from an installed wheel).

Every fenced block of language `python` or `bash` runs, unless the line right before it (blank lines
between are allowed) is a marker:

    <!-- skip-test: needs a GPU -->               the block is not run; the reason is reported
    <!-- test-exit: 1 (why it exits 1) -->        a bash block that ends with this exit status

The python blocks run in order as one script (a later block may use an earlier one's `llm`); each
bash block runs alone under `bash -e`. Indented (4-space) blocks are prose and are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*(skip-test|test-exit):\s*(.*?)\s*-->", re.DOTALL)


@dataclass
class Snippet:
    """One fenced block of the README."""

    language: str
    code: str
    line: int
    """The README line of the opening fence (1-based), for messages."""
    skip: str | None = None
    """Why it is not run (its skip-test marker), or None."""
    exit_code: int = 0


def readme_snippets(text: str | None = None) -> list[Snippet]:
    """The python and bash blocks of the README (or of `text`), markers read."""
    text = README.read_text(encoding="utf-8") if text is None else text
    snippets = []
    for match in _FENCE.finditer(text):
        language = match.group(1)
        if language not in ("python", "bash"):
            continue
        snippet = Snippet(language, match.group(2), text.count("\n", 0, match.start()) + 1)
        before = text[: match.start()].rstrip()
        marker = _MARKER.fullmatch(before[before.rfind("<!--") :]) if before.endswith("-->") else None
        if marker is not None:
            kind, value = marker.groups()
            if kind == "skip-test":
                if not value:
                    raise ValueError(f"README.md line {snippet.line}: a skip-test marker needs a reason")
                snippet.skip = value
            else:
                exit_code = re.match(r"\d+", value)
                if exit_code is None:
                    raise ValueError(f"README.md line {snippet.line}: test-exit needs a number, got {value!r}")
                snippet.exit_code = int(exit_code.group())
        snippets.append(snippet)
    return snippets


def python_script(snippets: list[Snippet]) -> str:
    """The runnable python blocks as one script, each announced on stdout by its README line."""
    parts = [
        f"print('### README.md line {s.line}', flush=True)\n{s.code}"
        for s in snippets
        if s.language == "python" and s.skip is None
    ]
    return "\n".join(parts)
