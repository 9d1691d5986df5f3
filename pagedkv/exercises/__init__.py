"""Workbook exercises: each notebook's exercise calls a checker here, which recomputes the
answer from the live engine (never a stored value) and says what is wrong, not just "no"."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckResult:
    """Outcome of one exercise check; renders as one line in a notebook."""

    ok: bool
    message: str

    def __repr__(self) -> str:
        return ("✅ " if self.ok else "❌ ") + self.message

    def __bool__(self) -> bool:
        return self.ok


def compare(what: str, got: object, expected: object, hint: str = "") -> CheckResult:
    """Equal -> ok; else a message naming the first difference (for lists) and a hint."""
    if got == expected:
        return CheckResult(True, f"{what}: correct.")
    detail = f"expected {expected!r}, got {got!r}"
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            detail = f"expected {len(expected)} entries, got {len(got)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            detail = f"entry {i} is {got[i]!r}, expected {expected[i]!r}"
    return CheckResult(False, f"{what}: {detail}." + (f" Hint: {hint}" if hint else ""))
