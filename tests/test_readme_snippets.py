"""The README's code blocks and their markers, as tests/readme_snippets.py reads them (the blocks
themselves run from an installed wheel in tests/test_wheel_install.py)."""

from __future__ import annotations

import ast

import pytest

from tests.readme_snippets import python_script, readme_snippets

EXAMPLE = """# Title

```python
x = 1
```

<!-- skip-test: needs a GPU -->

```python
import torch; torch.cuda.current_device()
```

    indented = "prose, not run"

<!-- test-exit: 1 (the starter fails) -->
```bash
false
```

```text
not code
```
"""


def test_markers_are_read() -> None:
    snippets = readme_snippets(EXAMPLE)
    assert [(s.language, s.line, s.skip, s.exit_code) for s in snippets] == [
        ("python", 3, None, 0),
        ("python", 9, "needs a GPU", 0),
        ("bash", 16, None, 1),
    ]
    assert python_script(snippets) == "print('### README.md line 3', flush=True)\nx = 1\n"


@pytest.mark.parametrize("marker", ["<!-- skip-test: -->", "<!-- test-exit: soon -->"])
def test_a_marker_without_its_value_is_refused(marker: str) -> None:
    with pytest.raises(ValueError, match="README.md line 2: "):
        readme_snippets(f"{marker}\n```bash\ntrue\n```\n")


def test_the_readme_blocks_parse_and_every_skip_says_why() -> None:
    snippets = readme_snippets()
    runnable = [s for s in snippets if s.skip is None]
    assert {s.language for s in runnable} == {"python", "bash"}, "the README's examples are no longer found"
    ast.parse(python_script(snippets))  # one script, in README order
    for s in snippets:
        assert s.code.strip(), f"README.md line {s.line}: an empty block"
