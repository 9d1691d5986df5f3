"""Shared by the checker tests: what a rejection must look like."""

from __future__ import annotations

from pagedkv.exercises import FAIL_MARK, CheckResult


def assert_rejected(result: CheckResult, *phrases: str) -> None:
    """`result` fails, shows the fail mark, and its message contains every phrase."""
    assert isinstance(result, CheckResult)
    assert not result, result.message
    assert repr(result).startswith(FAIL_MARK)
    for phrase in phrases:
        assert phrase in result.message, result.message
