"""Checker of notebook 00 (environment): accepts a right answer written here; rejects wrong ones with a
message naming the broken rule but never the answer; turns away the package's selector handed back or
called (also from another thread) and code that reads the checker's frames; offers reveal() after three
wrong tries."""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedkv import LLM
from pagedkv.attention.selector import get_attn_backend
from pagedkv.exercises import environment, reveal
from pagedkv.exercises.environment import check_choose_backend, environment_report, html_table, runs_here
from pagedkv.workbook import list_notebooks
from tests.exercises.checks import StrEqualToAnything, assert_rejected, revealed


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", num_kv_blocks=32)


def right(priority: list[str], reasons: dict[str, list[str]]) -> str | None:
    for name in priority:
        if not reasons[name]:
            return name
    return None


def test_environment_report_and_workbook_map() -> None:
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["default device"] in ("cpu", "cuda")
    assert [nb.name[:2] for nb in list_notebooks()] == [f"{i:02d}" for i in range(17)]
    assert runs_here("cpu").startswith("yes")
    with pytest.raises(ValueError):
        runs_here("tpu")


def test_html_table_escapes_and_follows_the_theme() -> None:
    table = html_table(["name", "n"], [("a<b", 3), ("a long cell that may wrap inside the table", 4)], align="lr")
    assert "a&lt;b" in table and 'text-align:right; white-space:nowrap;">3<' in table
    assert 'text-align:left;">a long cell' in table  # only long cells wrap
    assert "var(--jp-ui-font-color1" in table and "#fff" not in table.lower()


def test_choose_backend_passes_a_right_rule(tiny: LLM) -> None:
    result = check_choose_backend(tiny, right)
    assert result, result.message
    assert "TORCH_REF serves 'model.layers.0.self_attn.attn'" in result.message


@pytest.mark.parametrize(
    ("wrong", "phrase"),
    [
        (lambda p, r: p[0], "refuses the layer"),  # right on this CPU (priority ['TORCH_REF', ...]) only
        # A backend that can serve the layer but is not in the list (on this CPU: TRITON_ATTN, in the live case).
        (
            lambda p, r: next((n for n in r if not r[n] and n not in p), None) or right(p, r),
            "only backends in the priority list",
        ),
        (lambda p, r: next((n for n in reversed(p) if not r[n]), None), "earlier in the priority list"),
        (lambda p, r: next((n for n in p if not r[n]), p[0]), "refuses the layer"),  # never None
        (lambda p, r: "TORCH_REF", "TORCH_REF"),  # the live engine's answer, copied
        (lambda p, r: 0, "a str"),
    ],
)
def test_choose_backend_names_the_broken_rule_not_the_answer(tiny: LLM, wrong, phrase: str) -> None:
    result, work = revealed(lambda: check_choose_backend(tiny, wrong))
    assert_rejected(result, "For priority", phrase)
    assert "expected" not in result.message
    # The right answer of the failing case, worked out by this test from the case the message shows:
    case = re.match(r"For priority (\[.*?\]); can serve: (.*?); refuse: (.*?): ", result.message)
    assert case is not None, result.message
    serve = case.group(2).split(", ")
    want = next((n for n in eval(case.group(1)) if n in serve), None)  # noqa: S307  (a list of names)
    assert f"return {want!r}" not in result.message and f"answer: {want!r}" not in result.message
    assert f"answer: {want!r}" in work


def test_choose_backend_turns_away_the_package_and_frame_readers(tiny: LLM) -> None:
    def via_selector(p: list[str], r: dict[str, list[str]]) -> object:
        return get_attn_backend(head_size=16, dtype=None, kv_cache_dtype=None, block_size=16)

    def on_a_thread(p: list[str], r: dict[str, list[str]]) -> object:
        with ThreadPoolExecutor() as pool:
            return pool.submit(via_selector, p, r).result()

    def reads_frames(p: list[str], r: dict[str, list[str]]) -> object:
        frame = sys._getframe(1)
        while frame is not None:  # any "want" / "expected" a checker might hold
            for key in ("want", "expected", "chosen"):
                if key in frame.f_locals:
                    return frame.f_locals[key]
            frame = frame.f_back
        return right(p, r)

    assert_rejected(check_choose_backend(tiny, get_attn_backend), "pagedkv's own get_attn_backend")
    assert_rejected(check_choose_backend(tiny, via_selector), "calls get_attn_backend")
    assert_rejected(check_choose_backend(tiny, on_a_thread), "get_attn_backend")
    assert_rejected(check_choose_backend(tiny, reads_frames), "reading the checker's frames")
    assert_rejected(check_choose_backend(tiny, "TORCH_REF"), "function itself")


def test_choose_backend_keeps_no_reference_answer_to_import() -> None:
    assert not [name for name in vars(environment) if "expected" in name or "choice" in name.lower()]


def test_choose_backend_offers_reveal_after_three_tries(tiny: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_choose_backend(tiny, right)  # a pass resets the count
    messages = [check_choose_backend(tiny, lambda p, r: p[-1]).message for _ in range(3)]
    assert "reveal()" not in messages[0] and "reveal()" not in messages[1]
    assert "Stuck? `reveal()`" in messages[2]
    reveal()
    shown = capsys.readouterr().out
    assert shown.startswith("00: be the selector, worked out:")
    assert "-> the selector takes it" in shown or "every backend in the list refuses" in shown
    assert "answer: " in shown


def test_choose_backend_is_not_fooled_by_a_str_that_equals_everything(tiny: LLM) -> None:
    assert_rejected(
        check_choose_backend(tiny, lambda p, r: StrEqualToAnything(p[0])), "which refuses the layer"
    )  # graded as the str it holds
