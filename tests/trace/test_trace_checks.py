"""A trace's values are checked as it loads: each bad value is a ValueError naming the file and the
field's path, never a raw error from a widget later (or an 80 GB allocation)."""

from __future__ import annotations

import copy
import json
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedkv.trace import StepTrace

SHIPPED = Path(__file__).resolve().parents[2] / "notebooks" / "traces" / "h200_tiny-hybrid.json"


@pytest.fixture(scope="module")
def payload() -> dict[str, Any]:
    """The shipped trace, its first step given a block pool (it was recorded before pools were)."""
    payload = json.loads(SHIPPED.read_text())
    payload["steps"][0]["block_pools"] = [{"num_blocks": 32, "held": [[0, 1]], "cached": [], "free_queue": [[1, 31]]}]
    return payload


def test_a_good_trace_loads(payload: dict[str, Any]) -> None:
    """The checks refuse only bad values: the edited shipped trace loads, its pool as written."""
    trace = StepTrace.from_json(json.dumps(payload))
    assert trace[0].block_pools[0].free_queue_order() == list(range(1, 32))


def test_the_shipped_trace_loads_by_name() -> None:
    """`load_shipped` finds the package's copy (an installed wheel has no notebooks/ beside the user)."""
    by_name = StepTrace.load_shipped("h200_tiny-hybrid")
    assert by_name.to_json() == StepTrace.load(SHIPPED).to_json()
    assert len(by_name) == len(json.loads(SHIPPED.read_text())["steps"]) == 26
    with pytest.raises(
        ValueError, match=r"No shipped trace 'h100_nope'; the shipped step traces are \['h200_tiny-hybrid'"
    ):
        StepTrace.load_shipped("h100_nope")


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """An edit of the payload: the field at `path` (as the error names it, "steps[0].requests[0].x") := value."""

    def edit(payload: dict[str, Any]) -> None:
        keys = [int(k) if k.isdigit() else k for k in re.findall(r"\w+", path)]
        target = payload
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _first_held_step(payload: dict[str, Any]) -> int:
    return next(i for i, s in enumerate(payload["steps"]) if s["requests"] and s["requests"][0]["block_ids"][0])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("engine.num_blocks", 10**10, r"engine\.num_blocks = 10000000000: must be an int in \[1, 16777217\)"),
        ("engine.num_blocks", 0, r"engine\.num_blocks = 0: must be an int in \[1, "),
        ("engine.block_size", -16, r"engine\.block_size = -16: must be an int in \[1, 65537\) \(tokens per block\)"),
        ("engine.block_size", "16", r"engine\.block_size = '16': must be an int"),
        ("engine.max_num_seqs", 0, r"engine\.max_num_seqs = 0: must be an int in \[1, "),
        (
            "steps.0.requests.0.num_new_tokens",
            -3,
            r"steps\[0\]\.requests\[0\]\.num_new_tokens = -3: must be an int in \[0, ",
        ),
        ("steps.0.requests.0.num_computed_tokens", 1.5, r"steps\[0\]\.requests\[0\]\.num_computed_tokens = 1\.5: must"),
        ("steps.0.positions.0", -1, r"steps\[0\]\.positions\[0\] = -1: must be an int in \[0, "),
        (
            "steps.0.slot_mappings.0.0",
            32 * 16,
            r"steps\[0\]\.slot_mappings\[0\]\[0\] = 512: must be an int in \[-1, 512\)",
        ),
        ("steps.0.num_free_blocks.0", 33, r"steps\[0\]\.num_free_blocks\[0\] = 33: must be an int in \[0, 33\)"),
        ("steps.0.duration_s", float("nan"), r"steps\[0\]\.duration_s = nan: must be a number of seconds >= 0"),
        ("steps.0.block_pools.0.num_blocks", 10**10, r"steps\[0\]\.block_pools\[0\]\.num_blocks = 10000000000: must"),
        (
            "steps.0.block_pools.0.held",
            [[40, 1]],
            r"steps\[0\]\.block_pools\[0\]\.held\[0\]\[0\] = 40: must be an int in \[0, 32\)",
        ),
        (
            "steps.0.block_pools.0.held",
            [[1, -1]],
            r"steps\[0\]\.block_pools\[0\]\.held\[0\]\[1\] = -1: must .* reference count",
        ),
        (
            "steps.0.block_pools.0.free_queue",
            [[5, 2]],
            r"steps\[0\]\.block_pools\[0\]\.free_queue\[0\]\[1\] = 2: must be an int in \[5, 32\)",
        ),
        (
            "steps.0.block_pools.0.free_queue",
            [[5]],
            r"steps\[0\]\.block_pools\[0\]\.free_queue\[0\] = \[5\]: must be a pair",
        ),
    ],
)
def test_bad_values_are_named(tmp_path: Path, payload: dict[str, Any], field: str, value: object, message: str) -> None:
    """Before, each of these loaded (only format and shapes were checked); the views then failed with
    an IndexError, or (num_blocks=10**10) tried to allocate a list of 10**10 ref counts."""
    bad = copy.deepcopy(payload)
    _set(field, value)(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    prefix = re.escape(f"{path} is not a readable pagedkv-trace v1 file: ValueError: ")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="^" + prefix + message):
            StepTrace.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"loading the bad trace allocated {peak / 2**20:.0f} MiB before refusing it"


def test_a_block_id_outside_the_pool_is_named(tmp_path: Path, payload: dict[str, Any]) -> None:
    bad = copy.deepcopy(payload)
    i = _first_held_step(bad)
    bad["steps"][i]["requests"][0]["block_ids"][0][0] = 32  # the pool has blocks 0 .. 31
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"steps[{i}].requests[0].block_ids[0][0] = 32: must be an int in [0, 32) (a block of the pool: "
            "engine.num_blocks is 32)."
        ),
    ):
        StepTrace.load(path)


@pytest.mark.parametrize("opening", ["[", '{"a":'])
def test_deeply_nested_json_is_named_not_a_recursion_error(tmp_path: Path, opening: str) -> None:
    """Before: RecursionError, from inside json's parser."""
    path = tmp_path / "deep.json"
    path.write_text(opening * 100_000)
    with pytest.raises(
        ValueError, match="^" + re.escape(f"{path} is not a readable pagedkv-trace v1 file: ") + ".*nested too deeply"
    ):
        StepTrace.load(path)
