"""The checker tests start each from no wrong tries (overrides the root conftest's `fresh_tries`)."""

from __future__ import annotations

import pytest

from pagedkv.exercises import forget_tries


@pytest.fixture(autouse=True)
def fresh_tries() -> None:
    """Every checker test starts with no wrong tries counted and nothing to reveal."""
    forget_tries()
