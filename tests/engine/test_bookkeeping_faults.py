"""An exception inside the engine's own bookkeeping (issue 44, point 5) leaves the engine consistent:
no request lost, no token lost, no block cached whose K/V were never written, the engine callable.

- Planning: `Scheduler.schedule` raising part-way (a `MemoryError` in `allocate_slots` after an
  earlier admission of the same plan hashed the blocks it is to fill) takes its plan back. Before,
  the pending hashes outlived it: the next step committed them, and later prompts with that prefix
  were served K/V never written (wrong tokens, no error).
- Booking: an exception while one request's tokens are booked (`Scheduler.update`, the detokenizer,
  the n-gram proposer) ends that request alone with finish_reason "error"; the step's others are
  delivered. Before, the step's outputs were lost and the engine could be left unable to schedule.

Faults are injected by wrapping one engine function so that it raises once (or, for one request,
from some call on); the tokens are compared with a fresh engine's greedy tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import pagedkv.engine.llm as llm_module
from pagedkv import LLM, RequestOutput
from pagedkv.engine.request import Request
from tests.engine.test_engine_api import assert_idle
from tests.test_interrupts import GREEDY, PROMPTS, engine, tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


class Fault:
    """Wraps a function so that it raises `error` at its `at`-th call (counted from 1) among those
    where `when(*args)` holds, and at every such call after it if `sticky`; if `after`, the call is
    made first (the function raised at its end, its work done)."""

    def __init__(
        self,
        error: BaseException,
        at: int = 1,
        when: Callable[..., bool] | None = None,
        sticky: bool = False,
        after: bool = False,
    ) -> None:
        self.error, self.at, self.when, self.sticky, self.after = error, at, when, sticky, after
        self.calls = self.raised = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.when is None or self.when(*args):
                self.calls += 1
                if self.calls == self.at or (self.sticky and self.calls > self.at):
                    self.raised += 1
                    if self.after:
                        fn(*args, **kwargs)
                    raise self.error
            return fn(*args, **kwargs)

        return wrapped


def inject(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, fault: Fault) -> Fault:
    monkeypatch.setattr(owner, name, fault.wrap(getattr(owner, name)))
    return fault


@pytest.fixture(scope="module")
def fresh() -> list[RequestOutput]:
    """PROMPTS' outputs from a fresh engine that meets no fault."""
    return engine().generate(PROMPTS, GREEDY)


def drain(llm: LLM, ids: list[str]) -> dict[str, RequestOutput]:
    """step() until the engine is idle; each request's final output, checking that every request added
    gets exactly one and that only a request's last output says it failed."""
    final: dict[str, RequestOutput] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id not in final, f"request {out.request_id} streamed after its final output"
            if out.finished:
                final[out.request_id] = out
            else:
                assert out.error is None and out.outputs[0].finish_reason is None
    assert sorted(final) == sorted(ids), "every request added returns a final output"
    return final


def check_outputs(
    outputs: list[RequestOutput], fresh: list[RequestOutput], failed: set[int], match: str = "injected"
) -> None:
    """The requests at the indices `failed` ended with an error naming the fault, keeping a prefix of the
    fresh tokens; every other one has exactly the fresh engine's tokens and text."""
    for i, (out, ref) in enumerate(zip(outputs, fresh)):
        got, want = out.outputs[0], ref.outputs[0]
        if i in failed:
            assert got.finish_reason == "error" and match in out.error, (i, got, out.error)
            assert got.token_ids == want.token_ids[: len(got.token_ids)], "tokens booked before the fault are kept"
        else:
            assert out.error is None and (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
            ), i


def check_serves_again(llm: LLM, fresh: list[RequestOutput]) -> None:
    """Idle, nothing left over; the same prompts again (twice: the second reads what the first cached)
    give the fresh engine's tokens."""
    assert_idle(llm)
    for _ in range(2):
        assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(fresh)
    assert llm.stats.num_cached_tokens > 0, "the reruns did read the prefix cache"


# ---- planning: Scheduler.schedule raising part-way ----------------------------------------------

# allocate_slots' calls in the first step: one per admission, PROMPTS in order (they share 3 blocks,
# hashed by the first admission and shared by the others). Under async scheduling, calls 4-6 plan the
# second step before the first is booked: the running requests' decodes. "after": allocate_slots
# raises once it has allocated and hashed (the request is half admitted).
SCHEDULE_FAULTS = [(2, False, False), (3, False, False), (3, False, True), (2, True, False), (5, True, True)]


@pytest.mark.parametrize(("at", "async_scheduling", "after"), SCHEDULE_FAULTS)
def test_schedule_raising_part_way_is_taken_back_and_planned_again(
    at: int, async_scheduling: bool, after: bool, monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    """The plan is taken back (nothing cached, the queue as it was) and the next step() plans it again:
    the requests finish with the fresh engine's tokens."""
    llm = engine(async_scheduling=async_scheduling)
    fault = Fault(MemoryError("injected"), at, after=after)
    inject(monkeypatch, llm.kv_cache_manager, "allocate_slots", fault)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    final: dict[str, RequestOutput] = {}
    with pytest.raises(MemoryError, match="injected") as raised:
        while True:  # under async scheduling the fault comes in the first call's second plan
            final.update({out.request_id: out for out in llm.step() if out.finished})
    assert fault.raised == 1
    assert "plan was taken back" in "".join(raised.value.__notes__)
    kv = llm.kv_cache_manager
    assert kv._pending == [], "no hash of the failed plan is left pending (the next commit would keep it)"
    if at <= len(PROMPTS):  # the first plan failed: everything as before it
        assert list(llm.scheduler.waiting) == [llm._requests[i] for i in ids] and llm.scheduler.running == []
        assert kv.num_free_blocks() == kv.num_usable_blocks and kv.req_to_blocks == {}
        assert all(not pool.cached_block_hash_to_block for pool in kv.block_pools), "no hash outlives the plan"
    final.update(drain(llm, [i for i in ids if i not in final]))
    check_outputs([final[i] for i in ids], fresh, failed=set())
    check_serves_again(llm, fresh)


@pytest.mark.parametrize("at", [2, 3])
def test_generate_whose_schedule_raises_caches_nothing_unwritten(
    at: int, monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    """The issue's reproducer: generate() aborts its requests on the exception; before, the blocks that
    the failed plan's first admission hashed stayed findable, and the rerun was served unwritten K/V."""
    llm = engine()
    inject(monkeypatch, llm.kv_cache_manager, "allocate_slots", Fault(MemoryError("injected"), at))
    with pytest.raises(MemoryError, match="injected"):
        llm.generate(PROMPTS, GREEDY)
    assert all(not pool.cached_block_hash_to_block for pool in llm.kv_cache_manager.block_pools)
    check_serves_again(llm, fresh)


def test_requests_aborted_after_a_schedule_fault_leave_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    llm = engine()
    inject(monkeypatch, llm.kv_cache_manager, "allocate_slots", Fault(MemoryError("injected"), 3))
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    with pytest.raises(MemoryError, match="injected"):
        llm.step()
    assert all(llm.abort_request(i) for i in ids)
    check_serves_again(llm, fresh)


# ---- booking: an exception while one request's step is booked -------------------------------------


def faulty_request(request_id: str) -> Callable[..., bool]:
    """`when` for a method of Request: the call is on the request `request_id`."""
    return lambda request, *args: request.request_id == request_id


def fault_in(point: str, monkeypatch: pytest.MonkeyPatch, llm: LLM) -> tuple[Fault, set[int]]:
    """Inject the fault `point` into a fresh `llm` (before PROMPTS are added, as ids "0" "1" "2"); the
    fault and the indices of the requests it ends."""
    detokenizers.clear()
    init = llm_module.IncrementalDetokenizer.__init__

    def recording_init(detokenizer: llm_module.IncrementalDetokenizer, *args: Any) -> None:
        init(detokenizer, *args)
        detokenizers.append(detokenizer)

    monkeypatch.setattr(llm_module.IncrementalDetokenizer, "__init__", recording_init)
    if point == "update":  # Scheduler.update, booking request 1's second token
        fault = Fault(RuntimeError("injected"), 2, when=faulty_request("1"))
        return inject(monkeypatch, Request, "check_stop", fault), {1}
    if point == "update-memory":  # ... request 0's first token, with a MemoryError
        fault = Fault(MemoryError("injected"), 1, when=faulty_request("0"))
        return inject(monkeypatch, Request, "check_stop", fault), {0}
    if point == "detokenize-batch":  # the step's batched decode, once: each request's text is made alone
        return inject(monkeypatch, llm_module, "detokenize_batch", Fault(RuntimeError("injected"), 3)), set()
    if point == "detokenizer-once":  # one request's detokenizer, once: the batch fails, its retry not
        fault = Fault(RuntimeError("injected"), 2, when=lambda detokenizer, *args: detokenizer is detokenizers[2])
        return inject(monkeypatch, llm_module.IncrementalDetokenizer, "update", fault), set()
    if point == "detokenizer":  # one request's detokenizer, from its third text on: that request ends
        fault = Fault(MemoryError("injected"), 3, sticky=True, when=lambda d, *args: d is detokenizers[2])
        return inject(monkeypatch, llm_module.IncrementalDetokenizer, "update", fault), {2}
    if point == "detokenizer-first":  # ... from its first text on (generate() makes a text at the end only)
        fault = Fault(MemoryError("injected"), 1, sticky=True, when=lambda d, *args: d is detokenizers[2])
        return inject(monkeypatch, llm_module.IncrementalDetokenizer, "update", fault), {2}
    if point == "ngram":  # the n-gram proposer, its fourth call (a request's next drafts)
        assert llm._ngram is not None
        return inject(monkeypatch, llm._ngram, "propose", Fault(RuntimeError("injected"), 4)), {-1}
    raise AssertionError(point)


detokenizers: list[llm_module.IncrementalDetokenizer] = []
"""The current test's requests' detokenizers, in the order made (the requests'): a fault may pick one."""

BOOKING_FAULTS = [
    ("update", False),
    ("update-memory", False),
    ("detokenize-batch", False),
    ("detokenizer-once", False),
    ("detokenizer", False),
    ("ngram", False),
    ("update", True),
    ("update-memory", True),
    ("detokenize-batch", True),
    ("detokenizer", True),
]


def booking_engine(point: str, async_scheduling: bool) -> LLM:
    return engine(async_scheduling=async_scheduling, speculative_config=NGRAM if point == "ngram" else None)


@pytest.mark.parametrize(
    ("point", "async_scheduling"), BOOKING_FAULTS, ids=[f"{p}{'-async' if a else ''}" for p, a in BOOKING_FAULTS]
)
def test_a_fault_while_booking_ends_only_its_request_when_streaming(
    point: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    llm = booking_engine(point, async_scheduling)
    fault, failed = fault_in(point, monkeypatch, llm)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    final = drain(llm, ids)
    assert fault.raised >= 1, "the fault was injected"
    outputs = [final[i] for i in ids]
    if failed == {-1}:  # the proposer's call does not name its request: the one that failed
        failed = {i for i, out in enumerate(outputs) if out.outputs[0].finish_reason == "error"}
        assert len(failed) == 1
    check_outputs(outputs, fresh, failed)
    check_serves_again(llm, fresh)


@pytest.mark.parametrize(
    ("point", "async_scheduling"),
    [
        ("update", False),
        ("update-memory", True),
        ("detokenize-batch", False),
        ("detokenizer-first", True),
        ("ngram", False),
    ],
)
def test_a_fault_while_booking_ends_only_its_request_in_generate(
    point: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    """generate() returns every prompt's output: the failed request's with finish_reason "error"."""
    llm = booking_engine(point, async_scheduling)
    fault, failed = fault_in(point, monkeypatch, llm)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert fault.raised >= 1
    if failed == {-1}:
        failed = {i for i, out in enumerate(outputs) if out.outputs[0].finish_reason == "error"}
        assert len(failed) == 1
    check_outputs(outputs, fresh, failed)
    check_serves_again(llm, fresh)


def test_counters_raising_after_the_outputs_keep_them_for_the_next_call(
    monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    """What follows a step's outputs concerns no request: if it raises, step() raises (with a note) and
    the next call returns the outputs first. Here in the step where the requests finish (the 7th:
    a prefill and 6 tokens), so a lost output would be a lost request."""
    llm = engine()
    fault = inject(monkeypatch, llm.stats, "count_step", Fault(RuntimeError("injected"), 6))
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    final: dict[str, RequestOutput] = {}
    with pytest.raises(RuntimeError, match="injected") as raised:
        while llm.has_unfinished_requests():
            final.update({out.request_id: out for out in llm.step() if out.finished})
    assert fault.raised == 1 and "outputs are kept" in "".join(raised.value.__notes__)
    assert final == {} and llm.has_unfinished_requests()
    final.update(drain(llm, ids))
    check_outputs([final[i] for i in ids], fresh, failed=set())
    check_serves_again(llm, fresh)


# ---- abort_request racing the step ----------------------------------------------------------------


def test_an_abort_from_another_thread_waits_for_the_step_to_end(
    monkeypatch: pytest.MonkeyPatch, fresh: list[RequestOutput]
) -> None:
    """A server may call abort_request from another thread while step() runs. It takes effect between
    steps, as vLLM's engine core applies aborts between steps. Before, one landing in the forward
    finished its request under the step's feet: the step failed (a KeyError) and with it every
    request of the batch."""
    llm = engine()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    aborted: list[bool] = []
    thread = threading.Thread(target=lambda: aborted.append(llm.abort_request(ids[1])))
    real, calls, waited = llm.runner.execute_model, [], []

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 2:  # the second step's forward: the abort of request 1 comes in meanwhile
            thread.start()
            thread.join(timeout=0.3)
            waited.append(not aborted)  # checked here: once the step ends the lock is free
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "execute_model", forward)
    outputs = llm.step() + llm.step()
    assert waited == [True], "the abort waited for the step"
    thread.join(timeout=30)
    assert aborted == [True]
    assert all(out.error is None for out in outputs)
    final = drain(llm, [ids[0], ids[2]])
    assert [final[ids[0]].outputs[0].token_ids, final[ids[2]].outputs[0].token_ids] == tokens(fresh)[::2]
    check_serves_again(llm, fresh)
