"""`engine_args_doc()`: the per-argument docs that `help(LLM)` is to show, made from EngineArgs."""

from __future__ import annotations

import re
from dataclasses import fields

from pagedkv.engine.arg_utils import EngineArgs, engine_args_doc


def test_every_argument_is_documented_with_its_default() -> None:
    section = engine_args_doc()
    assert section.splitlines()[0] == "Args:"
    assert all(len(line) <= 100 for line in section.splitlines())
    # An entry starts at 4 spaces; its wrapped lines at 8: unwrapped, one line per argument.
    entries = re.split(r"\n    (?=\S)", section.removeprefix("Args:\n    "))
    entries = [" ".join(entry.split()) for entry in entries]
    assert [e.split(" ")[0] for e in entries] == [f.name for f in fields(EngineArgs)]
    # Hand-checked against the field's docstring in arg_utils.py.
    assert "block_size (default 16): Tokens per KV cache block (page)." in entries
    assert (
        "gpu_memory_utilization (default 0.9): Share in (0, 1] of the GPU's memory the engine may use in all "
        "(the name and meaning as in vLLM)."
    ) in entries
    assert all(re.fullmatch(r"\w+ \(default .*\): \S.*", e) for e in entries), entries
