"""Issue 46, item 4: the back doors of the exercises, each tried as a student would.

- Answers that claim to equal anything (an object, an int, a str, a list with its own `__eq__`)
  fail every checker, and their `__eq__` is never called: the checkers compare plain values they
  build themselves (`plain`).
- The tries and the worked answers cannot be reached from what a student can import or hold: not
  `_TRIES`, not `vars()` of a module, not `__closure__` / `__globals__` / `__wrapped__` of a checker
  or of `reveal`, not `gc.get_referrers` from a checker, a result or a title; a try cannot be forged.
  `reveal()` still works the answer out after three wrong tries.
- Notebook 14: a copy of a watched function run on a thread started before the check is turned
  away, and so is a sibling of the watched functions (another spec class's page size).
- An unanswered exercise (`...`, or a kernel that stores nothing) is neither passed nor failed, and
  spends no try.
"""

from __future__ import annotations

import gc
import importlib
import pkgutil
import sys
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import pagedkv.exercises as exercises
from pagedkv import LLM, SamplingParams
from pagedkv.config import parse_kv_cache_dtype
from pagedkv.exercises import CheckResult, exercise, forget_tries, reveal
from pagedkv.exercises.attention_groups import check_lengths, check_null_blocks
from pagedkv.exercises.cudagraph import check_lowering, check_raising
from pagedkv.exercises.environment import check_choose_backend
from pagedkv.exercises.flash_attention import check_kernel_block_rows
from pagedkv.exercises.mla import check_decode_split, check_mla_cache_bytes
from pagedkv.exercises.model_file import check_head_layout, check_qkv_width
from pagedkv.exercises.paged_kv import check_blocks_held, check_next_slot_mapping
from pagedkv.exercises.precision import check_num_blocks, check_num_splits
from pagedkv.exercises.prefix_caching import check_hit_length, check_next_block
from pagedkv.exercises.serving import check_next_schedule
from pagedkv.exercises.spec_decode import check_emitted, check_rollback_slots, check_spec_modes
from pagedkv.exercises.tensor_parallel import check_kv_cache_bytes, check_rank_heads
from pagedkv.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from tests.exercises.checks import assert_not_answered, assert_rejected

# ---- answers that say they equal anything ----------------------------------------------------------

EQ_CALLS: list[str] = []
"""Every call of a liar's __eq__ / __ne__: a checker must make none."""


class _Liar:
    def __eq__(self, other: object) -> bool:
        EQ_CALLS.append(f"{type(self).__name__}.__eq__")
        return True

    def __ne__(self, other: object) -> bool:
        EQ_CALLS.append(f"{type(self).__name__}.__ne__")
        return False

    def __hash__(self) -> int:
        return 0


class LyingObject(_Liar):
    """No number, list or str at all: only an __eq__ that says yes."""


class LyingInt(_Liar, int):
    """An int (0) that says it equals anything."""


class LyingStr(_Liar, str):
    """A str ("NONE") that says it equals anything."""


class LyingList(_Liar, list):  # type: ignore[type-arg]
    """A list ([0]) that says it equals anything."""


def liars() -> list[object]:
    """One of each, and tuples of them in the shapes the checkers ask for (a pair, three, four)."""
    one = LyingObject()
    return [one, LyingInt(0), LyingStr("NONE"), LyingList([0]), (one, one), (one, one, one), (one, one, one, one)]


@pytest.fixture(scope="module")
def engine() -> LLM:
    """A "tiny" engine after one step, with three requests in flight (notebook 02's exercise engine)."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    for prompt in ["blocks!", "slot", "paging"]:
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.step()
    return llm


# Each checker, and how a liar is handed to it: returned by the student's function, or given as the value.
FUNCTION_CHECKERS: dict[str, Callable[[Callable[..., Any]], CheckResult]] = {
    "01 qkv_width": lambda fn: check_qkv_width(fn, num_hidden=1),
    "01 head_layout": lambda fn: check_head_layout(fn, num_hidden=1),
    "05 lengths": check_lengths,
    "05 null_blocks": check_null_blocks,
    "07 kernel_block_rows": lambda fn: check_kernel_block_rows(fn, num_hidden=1),
    "10 rank_heads": lambda fn: check_rank_heads(fn, num_hidden=1),
    "10 kv_cache_bytes": lambda fn: check_kv_cache_bytes(fn, num_hidden=1),
    "11 mla_cache_bytes": lambda fn: check_mla_cache_bytes(fn, num_hidden=1),
    "11 decode_split": lambda fn: check_decode_split(fn, num_hidden=1),
    "12 hit_length": lambda fn: check_hit_length(fn, num_hidden=1),
    "12 next_block": lambda fn: check_next_block(fn, num_hidden=1),
    "13 emitted": lambda fn: check_emitted(fn, num_hidden=1),
    "13 rollback_slots": lambda fn: check_rollback_slots(fn, num_hidden=1),
    "14 num_splits": lambda fn: check_num_splits(fn, num_hidden=1),
    "14 num_blocks": lambda fn: check_num_blocks(fn, num_hidden=1),
}
VALUE_CHECKERS: dict[str, Callable[[object, LLM], CheckResult]] = {
    "02 blocks_held": lambda v, llm: check_blocks_held(llm, "1", v, v),
    "02 next_slot_mapping": lambda v, llm: check_next_slot_mapping(llm, v),
    "08 lowering": lambda v, llm: check_lowering(2, v),
    "08 raising": lambda v, llm: check_raising(v),
    "09 next_schedule": lambda v, llm: check_next_schedule(llm, {"0": v, "1": v, "2": v}, v),
    "13 spec_modes": lambda v, llm: check_spec_modes({"a": v, "b": v, "c": v, "d": v}),
}


def turned_away(result: CheckResult) -> None:
    """The liar failed (a real fail, not "not answered"), and no __eq__ of it was asked."""
    assert isinstance(result, CheckResult)
    assert not result and result.answered, result.message
    assert EQ_CALLS == [], (EQ_CALLS, result.message)


@pytest.mark.parametrize("name", sorted([*FUNCTION_CHECKERS, "00 choose_backend"]))
def test_a_function_returning_an_answer_that_equals_anything_fails(name: str, engine: LLM) -> None:
    for liar in liars():
        EQ_CALLS.clear()
        answer = lambda *args, liar=liar: liar  # noqa: E731
        if name == "00 choose_backend":
            turned_away(check_choose_backend(engine, answer))
        else:
            turned_away(FUNCTION_CHECKERS[name](answer))


@pytest.mark.parametrize("name", sorted(VALUE_CHECKERS))
def test_an_answer_that_equals_anything_fails(name: str, engine: LLM) -> None:
    for liar in liars():
        EQ_CALLS.clear()
        turned_away(VALUE_CHECKERS[name](liar, engine))


# ---- the tries and the worked answers ----------------------------------------------------------------

SECRET = "the worked answer is 42"
WORK_IDS: list[int] = []  # ids only: a list of the works themselves would be a way to them


@exercise("test: the answer is 42")
def check_42(answer: object) -> CheckResult:
    """A checker like the workbook's: a wrong answer's result is built with the worked answer."""

    def work() -> str:
        return SECRET

    WORK_IDS.append(id(work))
    return CheckResult(answer == 42, "42?", reveal=work)


def printed_by_reveal() -> str:
    import io
    from contextlib import redirect_stdout

    with redirect_stdout(io.StringIO()) as out:
        reveal()
    return out.getvalue()


def reachable(roots: list[object], depth: int = 6) -> Iterator[object]:
    """Every object an attribute walk reaches from `roots`: module namespaces of pagedkv.exercises,
    `__closure__` cells, `__globals__`, `__wrapped__`, `__dict__`, `__self__`, defaults, and the
    entries of lists, tuples, sets and dicts."""
    seen: set[int] = set()
    frontier = list(roots)
    for _ in range(depth):
        following: list[object] = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (int, float, str, bytes, type(None))):
                continue
            seen.add(id(obj))
            yield obj
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith("pagedkv.exercises"):
                    following += list(vars(obj).values())
                continue
            if isinstance(obj, types.CellType):
                try:
                    following.append(obj.cell_contents)
                except ValueError:
                    pass
                continue
            if isinstance(obj, dict):
                following += [*obj.keys(), *obj.values()]
            elif isinstance(obj, (list, tuple, set, frozenset)):
                following += list(obj)
            for attr in ("__closure__", "__globals__", "__wrapped__", "__dict__", "__self__", "__func__"):
                following.append(getattr(obj, attr, None))
            for attr in ("__defaults__", "__kwdefaults__", "fget", "reveal"):
                following.append(getattr(obj, attr, None))
        frontier = following


def exercise_modules() -> list[types.ModuleType]:
    return [exercises] + [
        importlib.import_module(info.name) for info in pkgutil.iter_modules(exercises.__path__, "pagedkv.exercises.")
    ]


def test_the_counter_of_tries_is_not_importable() -> None:
    with pytest.raises(ImportError):
        exec("from pagedkv.exercises import _TRIES")  # noqa: S102  (the issue's attack, as a student types it)
    for module in exercise_modules():
        for value in vars(module).values():
            assert type(value).__name__ not in ("_Tries", "Tries"), module.__name__


def test_no_walk_from_what_a_student_holds_reaches_a_worked_answer() -> None:
    WORK_IDS.clear()
    result = check_42(41)  # one wrong try
    assert not result and result.reveal is None  # the result does not carry its worked answer
    raw = check_42.__wrapped__  # type: ignore[attr-defined]
    assert raw(41).reveal is None  # nor does the checker called without its counter
    roots: list[object] = [*exercise_modules(), check_42, raw, reveal, result, sys.modules[__name__]]
    for holder in (check_42, raw, result, "test: the answer is 42"):
        roots += gc.get_referrers(holder)
    found = [obj for obj in reachable(roots) if id(obj) in WORK_IDS and callable(obj)]
    assert found == []
    assert SECRET not in printed_by_reveal()


def test_a_try_cannot_be_forged() -> None:
    # An event raised by hand counts nothing.
    check_42(41)
    sys.audit("pagedkv.exercises.tried")
    sys.audit("pagedkv.exercises.register")
    assert "1 wrong try so far" in printed_by_reveal()

    # Nor does a copy of the counting wrapper around a checker of one's own under the same title.
    def fails(answer: object) -> CheckResult:
        return CheckResult(False, "no", reveal=lambda: "mine")

    code, closure = check_42.__code__, check_42.__closure__ or ()
    cells = tuple(types.CellType(fails) if n == "check" else c for n, c in zip(code.co_freevars, closure))
    forged = types.FunctionType(code, check_42.__globals__, "counted", None, cells)
    forged(0)
    forged(0)
    check_42(41)
    assert "2 wrong tries so far" in printed_by_reveal() and SECRET not in printed_by_reveal()


def test_reveal_works_the_answer_out_after_three_wrong_tries() -> None:
    assert "Nothing to reveal" in printed_by_reveal()
    check_42(41)
    check_42(40)
    assert SECRET not in printed_by_reveal()
    third = check_42(39)
    assert "Try 3. Stuck? `reveal()`" in third.message
    assert SECRET in printed_by_reveal()
    assert check_42(42)  # a pass starts the count again
    assert "0 wrong tries so far" in printed_by_reveal()
    forget_tries()
    assert "Nothing to reveal" in printed_by_reveal()


# ---- notebook 14: a copy on an earlier thread, and a sibling ------------------------------------------


def right_blocks(memory: int, config: Any, block_size: int, kv_cache_dtype: str) -> int:
    itemsize = 1 if kv_cache_dtype.startswith("fp8") else {"float32": 4}.get(kv_cache_dtype, 2)
    per_block = 2 * block_size * config.num_key_value_heads * config.head_dim * itemsize * config.num_hidden_layers
    return memory // per_block


def test_a_copy_of_a_watched_function_on_a_thread_started_before_the_check_is_turned_away() -> None:
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its thread runs before the check begins: no profiler was set on it
    page = KVCacheSpec.page_size_bytes.fget  # type: ignore[attr-defined]
    copies = [
        types.FunctionType(page.__code__, page.__globals__, "mine"),  # the same code in a new function
        types.FunctionType(page.__code__.replace(co_name="mine"), page.__globals__, "mine"),  # a renamed copy
    ]

    def through(copy: Callable[..., int]) -> Callable[..., int]:
        def blocks(memory: int, config: Any, block_size: int, kv_cache_dtype: str) -> int:
            dtype = parse_kv_cache_dtype(kv_cache_dtype, None)
            spec = FullAttentionSpec(block_size, config.num_key_value_heads, config.head_dim, dtype)
            return memory // (pool.submit(copy, spec).result() * config.num_hidden_layers)

        return blocks

    for copy in copies:
        assert_rejected(check_num_blocks(through(copy), num_hidden=2), "calls KVCacheSpec.page_size_bytes")
    assert check_num_blocks(right_blocks, num_hidden=2)
    pool.shutdown()


def test_a_sibling_of_the_watched_functions_is_watched_too() -> None:
    def by_the_mla_page(memory: int, config: Any, block_size: int, kv_cache_dtype: str) -> int:
        dtype = parse_kv_cache_dtype(kv_cache_dtype, None)
        page = MLAAttentionSpec(block_size, config.num_key_value_heads, config.head_dim, dtype).page_size_bytes
        return memory // (2 * page * config.num_hidden_layers)  # an MLA page has no V: twice it is K and V

    assert_rejected(check_num_blocks(by_the_mla_page, num_hidden=2), "MLAAttentionSpec.page_size_bytes")

    def the_reveals_rule(seq_len: int, batch_size: int, num_sms: int) -> int:
        from pagedkv.exercises.precision import _fixed_size_rule

        return _fixed_size_rule(seq_len)

    assert_rejected(check_num_splits(the_reveals_rule, num_hidden=2), "calls _fixed_size_rule")


# ---- not answered yet ------------------------------------------------------------------------------------


def test_an_answer_left_as_ellipsis_is_not_answered_and_spends_no_try(engine: LLM) -> None:
    for _ in range(4):  # Run All, again and again
        assert_not_answered(check_blocks_held(engine, "1", ..., ...))
        assert_not_answered(check_next_slot_mapping(engine, ...))
        assert_not_answered(check_lengths(...))
        assert_not_answered(check_lowering(1, ...))
        assert_not_answered(check_42(...))
    assert repr(check_42(...)).startswith("○ test: the answer is 42: not answered yet")
    assert "Nothing to reveal" in printed_by_reveal()
    check_42(41)
    assert "1 wrong try so far" in printed_by_reveal()


def test_a_kernel_that_stores_nothing_is_not_answered_and_spends_no_try() -> None:
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    from pagedkv.exercises.triton_puzzles import check_block_table_row

    @triton.jit
    def skeleton(block_table_ptr, seq_lens_ptr, slots_ptr, stride_bt, stride_slots, PAGE_SIZE: tl.constexpr):  # noqa: ANN001
        req = tl.program_id(0)  # noqa: F841  (notebook 06's skeleton: TODO comments, no store)

    def launch(kernel: Any, block_table: Any, seq_lens: Any, slots: Any, page_size: int) -> None:
        kernel[(block_table.shape[0],)](
            block_table, seq_lens, slots, block_table.stride(0), slots.stride(0), PAGE_SIZE=page_size
        )

    for _ in range(exercises.REVEAL_AFTER + 1):
        assert_not_answered(check_block_table_row(skeleton, launch))
    assert "Nothing to reveal" in printed_by_reveal()


def test_a_launcher_that_gives_the_output_a_lying_class_is_turned_away() -> None:
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    import torch

    from pagedkv.exercises.triton_puzzles import check_block_table_row

    class SaysClose(torch.Tensor):
        """A tensor class whose comparisons all come out equal."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            result = super().__torch_function__(func, types, args, kwargs or {})
            if func in (torch.isclose, torch.Tensor.__eq__, torch.equal):
                return True if func is torch.equal else torch.ones(torch.Tensor.size(result), dtype=torch.bool)
            return result

    @triton.jit
    def skeleton(block_table_ptr, seq_lens_ptr, slots_ptr, stride_bt, stride_slots, PAGE_SIZE: tl.constexpr):  # noqa: ANN001
        req = tl.program_id(0)  # noqa: F841

    def launch(kernel: Any, block_table: Any, seq_lens: Any, slots: Any, page_size: int) -> None:
        kernel[(block_table.shape[0],)](
            block_table, seq_lens, slots, block_table.stride(0), slots.stride(0), PAGE_SIZE=page_size
        )
        slots.__class__ = SaysClose

    assert_rejected(check_block_table_row(skeleton, launch), "the launcher made slots a SaysClose")
