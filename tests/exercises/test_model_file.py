"""Checkers of notebook 01 (the model file): accept a right answer written here; reject wrong ones with
a message naming the broken rule but never the answer; turn away the package's layout (handed back,
called, called from another thread, or a module built) and code that reads the checker's frames, also
on geometries the package refuses; offer reveal() after three wrong tries."""

from __future__ import annotations

import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedkv.exercises import model_file, reveal
from pagedkv.exercises.model_file import MODEL_HEADS, TP_SIZES, build_attention, check_head_layout, check_qkv_width
from pagedkv.models.layers import head_layout
from tests.exercises.checks import EqualToAnything, assert_rejected, revealed


def right_width(hidden_size: int, hq: int, hkv: int, head_dim: int, tp: int) -> int:
    return (hq // tp + 2 * max(hkv // tp, 1)) * head_dim


def right_layout(hq: int, hkv: int, tp: int) -> tuple[int, int, int] | None:
    if hq % tp or (hkv % tp if hkv >= tp else tp % hkv):
        return None  # the engine refuses the model
    return hq // tp, max(hkv // tp, 1), max(tp // hkv, 1)


def reads_frames(fallback):  # noqa: ANN001, ANN201
    """An answer that looks up the stack for a checker's answer, else computes a (wrong) one."""

    def answer(*args: int) -> object:
        frame = sys._getframe(1)
        while frame is not None:
            for key in ("expected", "want", "width"):
                if key in frame.f_locals:
                    return frame.f_locals[key]
            frame = frame.f_back
        return fallback(*args)

    return answer


def test_the_right_answers_agree_with_the_package_where_it_answers() -> None:
    rng = random.Random(0)
    made_up = [
        model_file._geometry(rng, kind)
        for kind in ("partitioned", "replicated", "uneven q", "uneven kv")
        for _ in range(50)
    ]
    for hq, hkv, tp in [(hq, hkv, tp) for hq, hkv in MODEL_HEADS for tp in TP_SIZES] + made_up:
        try:
            layout = head_layout(hq, hkv, tp)
        except ValueError:
            assert right_layout(hq, hkv, tp) is None
            continue
        assert right_layout(hq, hkv, tp) == (layout.num_heads, layout.num_kv_heads, layout.kv_head_replicas)
        if hq % hkv == 0:  # else LlamaAttention refuses to build it
            assert right_width(0, hq, hkv, 64, tp) == build_attention(hq, hkv, tp, 64).qkv_proj.out_features
    for kind in ("uneven q", "uneven kv"):  # the made-up geometries the package refuses are refused
        for _ in range(50):
            with pytest.raises(ValueError):
                head_layout(*model_file._geometry(rng, kind))


def test_qkv_width_passes_a_right_answer() -> None:
    result = check_qkv_width(right_width)
    assert result, result.message
    assert "(7 + 2 x 1) heads x 128" in result.message  # Qwen2-7B at tp_size 4, worked by hand: 1152


@pytest.mark.parametrize(
    ("wrong", "phrases"),
    [
        (lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d, ("fn(3584, 28, 4, 128, 4)", "whole model")),
        (lambda h, hq, hkv, d, tp: 3 * (hq // tp) * d, ("fn(3584, 28, 4, 128, 4)", "own K and V")),
        (lambda h, hq, hkv, d, tp: (hq // tp) * d, ("fn(3584, 28, 4, 128, 4)", "only the query part")),
        # Right for Qwen2-7B (4 KV heads over 4 ranks), wrong once KV heads are replicated: a fixed case.
        (lambda h, hq, hkv, d, tp: (hq // tp + 2 * (hkv // tp)) * d, ("fn(4096, 64, 8, 128, 16)", "replicated")),
        (lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d // tp, ("fn(4096, 64, 8, 128, 16)", "never cut")),
        (lambda h, hq, hkv, d, tp: 1152, ("fn(4096, 64, 8, 128, 16)", "is not it")),  # the notebook's number typed in
        (lambda h, hq, hkv, d, tp: "many", ("fn(3584, 28, 4, 128, 4)", "an int")),
    ],
)
def test_qkv_width_names_the_mistake_not_the_answer(wrong, phrases: tuple[str, ...]) -> None:
    result, work = revealed(lambda: check_qkv_width(wrong, num_hidden=0))
    assert_rejected(result, *phrases)
    case = re.match(r"fn\((\d+), (\d+), (\d+), (\d+), (\d+)\)", result.message)
    assert case is not None, result.message
    want = right_width(*map(int, case.groups()))
    assert str(want) not in result.message.replace(case.group(0), "")
    if "nothing to work out" not in work:  # an answer of the wrong form has none
        assert f"= {want}" in work


def test_qkv_width_turns_away_the_package() -> None:
    def built(h: int, hq: int, hkv: int, d: int, tp: int) -> int:
        return build_attention(hq, hkv, tp, d, h).qkv_proj.out_features

    def from_layout(h: int, hq: int, hkv: int, d: int, tp: int) -> int:
        layout = head_layout(hq, hkv, tp)
        return (layout.num_heads + 2 * layout.num_kv_heads) * d

    def built_on_a_thread(h: int, hq: int, hkv: int, d: int, tp: int) -> int:
        with ThreadPoolExecutor() as pool:
            return pool.submit(built, h, hq, hkv, d, tp).result()

    assert_rejected(check_qkv_width(build_attention), "pagedkv's own build_attention")
    assert_rejected(check_qkv_width(built), "calls build_attention")
    assert_rejected(check_qkv_width(from_layout), "calls head_layout")
    assert_rejected(check_qkv_width(built_on_a_thread), "build_attention")
    assert_rejected(check_qkv_width(reads_frames(lambda *a: 0)), "reading the checker's frames")
    assert_rejected(check_qkv_width(1152), "function itself")


def test_qkv_width_asks_about_a_geometry_the_module_refuses() -> None:
    # 48 query heads over 32 KV heads: LlamaAttention refuses to build it, so building cannot answer.
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        build_attention(48, 32, 16, 128, 3072)

    def built_or_guess(h: int, hq: int, hkv: int, d: int, tp: int) -> int:
        return right_width(h, hq, hkv, d, tp) if hq % hkv == 0 else 0

    assert_rejected(check_qkv_width(built_or_guess, num_hidden=0), "fn(3072, 48, 32, 128, 16)")


def test_head_layout_passes_a_right_answer() -> None:
    result = check_head_layout(right_layout)
    assert result, result.message


@pytest.mark.parametrize(
    ("wrong", "phrases"),
    [
        (lambda hq, hkv, tp: (hq // tp, hkv // tp, 1), ("KV heads per rank 0 is not it", "fraction of a head")),
        (lambda hq, hkv, tp: (hq // tp, max(hkv // tp, 1), 1), ("replicas of each KV head 1 is not it",)),
        (lambda hq, hkv, tp: (hq // tp, max(hkv // tp, 1), 2), ("nothing is copied",)),
        # Never refuses: the notebook's valid table passes, a geometry the engine refuses does not.
        (lambda hq, hkv, tp: (hq // tp, max(hkv // tp, 1), max(tp // hkv, 1)), ("the engine refuses this model",)),
        (lambda hq, hkv, tp: None, ("your function refused them",)),
        (lambda hq, hkv, tp: [hq // tp], ("tuple of three ints",)),
    ],
)
def test_head_layout_names_the_mistake_not_the_answer(wrong, phrases: tuple[str, ...]) -> None:
    result, work = revealed(lambda: check_head_layout(wrong))
    assert_rejected(result, *phrases)
    assert "expected" not in result.message
    case = re.match(r"For (\d+) query heads, (\d+) KV heads, tp_size (\d+)", result.message)
    assert case is not None, result.message
    want = right_layout(*map(int, case.groups()))
    assert str(want) not in result.message
    if "nothing to work out" not in work:
        assert f"-> {want}" in work


def test_head_layout_turns_away_the_package_on_every_thread_and_frame_readers() -> None:
    def on_a_thread(hq: int, hkv: int, tp: int) -> object:
        with ThreadPoolExecutor() as pool:
            return pool.submit(head_layout, hq, hkv, tp).result()

    def caught(hq: int, hkv: int, tp: int) -> object:
        try:
            return head_layout(hq, hkv, tp)
        except ValueError:
            return None

    assert_rejected(check_head_layout(head_layout), "pagedkv's own head_layout")
    assert_rejected(check_head_layout(caught), "calls head_layout")
    assert_rejected(check_head_layout(on_a_thread), "head_layout")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: build_attention(hq, hkv, tp)), "build_attention")
    assert_rejected(check_head_layout(reads_frames(right_layout)), "reading the checker's frames")
    assert_rejected(check_head_layout(42), "function itself")


def test_head_layout_has_cases_the_package_refuses_and_the_notebook_never_printed() -> None:
    # A table of every printed case fails on the made-up ones; the package itself (here a copy of its
    # code, which the guard cannot tell from the student's) raises on the geometries it refuses.
    printed = {(hq, hkv, tp): right_layout(hq, hkv, tp) for hq, hkv in MODEL_HEADS for tp in TP_SIZES}
    assert_rejected(check_head_layout(lambda hq, hkv, tp: printed.get((hq, hkv, tp), (0, 0, 0))), "For ")

    def package_arithmetic(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        if hq % tp or (hkv >= tp and hkv % tp) or (hkv < tp and tp % hkv):
            raise ValueError("not divisible")  # what head_layout does where the answer is None
        return right_layout(hq, hkv, tp)  # type: ignore[return-value]

    assert_rejected(check_head_layout(package_arithmetic), "raised ValueError")


def test_no_reference_answer_to_import() -> None:
    assert not [name for name in vars(model_file) if "expected" in name or "verdict" in name or "_layout_cases" in name]


def test_head_layout_offers_reveal_after_three_tries(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_head_layout(right_layout)  # a pass resets the count
    messages = [check_head_layout(lambda hq, hkv, tp: (hq // tp, hkv // tp, 1)).message for _ in range(3)]
    assert "reveal()" not in messages[1] and "Stuck? `reveal()`" in messages[2]
    reveal()
    shown = capsys.readouterr().out
    assert shown.startswith("01: the tensor-parallel head layout, worked out:")
    assert "fn(32, 8, 16): query heads 32 / 16 = 2; 8 KV heads < 16 ranks" in shown and "-> (2, 1, 2)" in shown


def test_an_int_that_equals_everything_is_only_its_value() -> None:
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: EqualToAnything(0), num_hidden=0), "0 is not it")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: tuple(EqualToAnything(0) for _ in range(3))), "is not it")
