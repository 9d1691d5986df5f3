"""`python -m pagedkv generate`: prefix caching is on unless --no-prefix-caching, and the
--show-steps table counts the prompt tokens each step found in the cache."""

from __future__ import annotations

import pytest

from pagedkv.__main__ import main as cli

# The same 10-token prompt twice (--n 2), blocks of 4: the second copy, admitted right after the
# first in step 1, finds the first's two full blocks (8 tokens) and computes only the last 2.
ARGV = [
    "generate",
    "--device",
    "cpu",
    "--num-kv-blocks",
    "16",
    "--block-size",
    "4",
    "--max-tokens",
    "2",
    "--prompt-token-ids",
    "1,2,3,4,5,6,7,8,9,10",
    "--n",
    "2",
    "--show-steps",
]


def table(out: str) -> list[dict[str, str]]:
    """The --show-steps rows as {column: value} (the header's "blocks used/free" is one column)."""
    header, *rows = out.splitlines()[:3]
    columns = header.replace("blocks used/free", "blocks").split()
    return [dict(zip(columns, row.split(), strict=True)) for row in rows]


def test_show_steps_counts_cached_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    cli(ARGV)
    captured = capsys.readouterr()
    first, second = table(captured.out)
    assert (first["reqs"], first["prefill"], first["cached"], first["decode"]) == ("2", "12", "8", "0")
    assert (second["prefill"], second["cached"], second["decode"]) == ("0", "0", "2")
    assert "8 prompt tokens from the prefix cache (40% hit rate)" in captured.err  # 8 of 20 looked up


def test_no_prefix_caching(capsys: pytest.CaptureFixture[str]) -> None:
    cli([*ARGV, "--no-prefix-caching"])
    captured = capsys.readouterr()
    first = table(captured.out)[0]
    assert (first["prefill"], first["cached"]) == ("20", "0")
    assert "prefix caching off" in captured.err
