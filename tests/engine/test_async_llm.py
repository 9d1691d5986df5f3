"""AsyncLLM (pagedkv/engine/async_llm.py): streams equal LLM.generate's, many concurrent requests,
a consumer that stops reading frees its request, abort, bad input, a dying engine, shutdown, Ctrl-C.

Plain asyncio: each test runs its coroutine with asyncio.run, under a timeout so that a hang fails."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from pagedkv import LLM, AsyncLLM, CompletionOutput, RequestOutput, SamplingParams, StepEvent
from pagedkv.engine.async_llm import EngineSnapshot, fold_output
from pagedkv.engine.request import Request
from pagedkv.worker.tp_executor import EngineDeadError
from tests.engine.test_engine_api import assert_idle

T = TypeVar("T")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
"""Runs for seconds unless aborted: a test that sees it end early saw the abort."""


@pytest.fixture(scope="module")
def shared_llm() -> Iterator[LLM]:
    llm = LLM("tiny", device="cpu", num_kv_blocks=320, block_size=16)
    yield llm
    llm.shutdown()


@pytest.fixture
def llm(shared_llm: LLM) -> Iterator[LLM]:
    """The shared LLM, idle before the test and checked idle after it (nothing leaked)."""
    assert_idle(shared_llm)
    yield shared_llm
    assert_idle(shared_llm)


def run(coroutine: Awaitable[T], timeout: float = 30) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


async def collect(engine: AsyncLLM, prompt: Any, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params, request_id)]


async def wait_until(engine: AsyncLLM, ready: Callable[[EngineSnapshot], bool], timeout: float = 5) -> EngineSnapshot:
    deadline = time.monotonic() + timeout
    while not ready(engine.stats):
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {engine.stats}"
        await asyncio.sleep(0.002)
    return engine.stats


def engine_idle(stats: EngineSnapshot) -> bool:
    return stats.num_requests_running == stats.num_requests_waiting == 0 and stats.kv_cache_usage == 0


def check_stream(outputs: list[RequestOutput], reference: RequestOutput, request_id: str) -> None:
    """Cumulative outputs, each with more tokens than the one before (one more, unless the consumer
    fell behind: test_each_step_is_streamed_as_it_comes checks that), only the last finished, ending
    as the reference."""
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[0] and all(
        len(later) > len(earlier) and later[: len(earlier)] == earlier for earlier, later in zip(tokens, tokens[1:])
    )
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1]
    assert last.request_id == request_id
    assert last.outputs[0].token_ids == reference.outputs[0].token_ids
    assert last.outputs[0].text == reference.outputs[0].text
    assert last.outputs[0].finish_reason == reference.outputs[0].finish_reason
    assert (last.prompt, last.prompt_token_ids) == (reference.prompt, reference.prompt_token_ids)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streams_equal_generate(llm: LLM, params: SamplingParams) -> None:
    prompts: list[Any] = ["Hello", "The cat sat", {"prompt_token_ids": [5, 6, 7, 8, 9]}]
    reference = llm.generate(prompts, params, use_tqdm=False)

    async def main() -> list[list[RequestOutput]]:
        async with AsyncLLM.from_llm(llm) as engine:
            return await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))

    for i, (outputs, ref) in enumerate(zip(run(main()), reference)):
        check_stream(outputs, ref, f"r{i}")


def test_each_step_is_streamed_as_it_comes(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """In lockstep (each step waits until the consumer has read the one before): one output a step."""
    reference = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    step, turn = llm.step, threading.Semaphore(1)

    def paced_step() -> list[RequestOutput]:
        assert turn.acquire(timeout=10), "the consumer did not read the previous step's output"
        return step()

    monkeypatch.setattr(llm, "step", paced_step)

    async def main() -> list[RequestOutput]:
        async with AsyncLLM.from_llm(llm) as engine:
            outputs = []
            async for output in engine.generate("Hello", GREEDY, "paced"):
                outputs.append(output)
                turn.release()
            return outputs

    outputs = run(main())
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, GREEDY.max_tokens + 1))
    check_stream(outputs, reference, "paced")


def test_a_consumer_that_falls_behind_gets_what_it_missed_at_once(llm: LLM) -> None:
    params = replace_max_tokens(GREEDY, 20)
    reference = llm.generate("Hello", params, use_tqdm=False)[0]

    async def main() -> list[RequestOutput]:
        async with AsyncLLM.from_llm(llm) as engine:
            outputs = []
            async for output in engine.generate("Hello", params, "slow"):
                outputs.append(output)
                if len(outputs) == 1:  # block the event loop while the engine thread runs the request to its end
                    deadline = time.monotonic() + 10
                    while engine.stats.num_requests_finished == 0 and time.monotonic() < deadline:
                        time.sleep(0.005)
            return outputs

    outputs = run(main())
    # The steps it missed came as one output (the very last may come on its own, if it was handed
    # over just after the consumer woke).
    assert len(outputs) <= 3
    assert len(outputs[1].outputs[0].token_ids) >= params.max_tokens - 1
    check_stream(outputs, reference, "slow")


def test_fifty_concurrent_requests(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(3 + i % 5)]} for i in range(50)]
    params = [replace_max_tokens(GREEDY if i % 2 else SEEDED, 3) for i in range(50)]
    reference = llm.generate(prompts, params, use_tqdm=False)

    async def main() -> tuple[list[list[RequestOutput]], EngineSnapshot]:
        async with AsyncLLM.from_llm(llm) as engine:
            results = await asyncio.gather(
                *(collect(engine, p, s, f"q{i}") for i, (p, s) in enumerate(zip(prompts, params)))
            )
            return results, await wait_until(engine, engine_idle)

    results, stats = run(main())
    for i, (outputs, ref) in enumerate(zip(results, reference)):
        check_stream(outputs, ref, f"q{i}")
    assert stats.num_requests_finished == 50 and stats.num_requests_aborted == 0


def replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return SamplingParams(**{**vars(params), "max_tokens": max_tokens})


@pytest.mark.parametrize("how", ["break", "aclose"])
def test_consumer_that_stops_reading_frees_its_request(llm: LLM, how: str) -> None:
    async def main() -> tuple[EngineSnapshot, EngineSnapshot]:
        async with AsyncLLM.from_llm(llm) as engine:
            before = engine.stats
            stream = engine.generate("Hello", LONG, "gone")
            if how == "break":  # the generator is closed when dropped (asyncio's async-generator hooks)
                async for output in stream:
                    if len(output.outputs[0].token_ids) >= 2:
                        break
                del stream
            else:
                async with contextlib.aclosing(stream):
                    await anext(stream)
                    await anext(stream)
            stats = await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 1)
            # The id is free again.
            [*_, last] = await collect(engine, "Hello", GREEDY, "gone")
            assert last.finished and len(last.outputs[0].token_ids) == GREEDY.max_tokens
            return before, stats

    before, stats = run(main())
    assert stats.num_requests_finished == 0
    assert stats.num_decode_tokens - before.num_decode_tokens < 100  # stopped long before its 1000 tokens


def test_cancelled_task_aborts_its_request(llm: LLM) -> None:
    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("Hello", LONG, "c"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 1)
            assert stats.num_requests_finished == 0

    run(main())


def test_abort(llm: LLM) -> None:
    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            two = asyncio.Event()
            seen: list[RequestOutput] = []

            async def consume() -> None:
                async for output in engine.generate("Hello", LONG, "a"):
                    seen.append(output)
                    if len(seen) == 2:
                        two.set()

            task = asyncio.create_task(consume())
            await two.wait()
            assert await engine.abort("a") is True
            await task  # the generator ends by itself: its last output says "abort"
            last = seen[-1]
            assert last.finished and last.request_id == "a" and last.outputs[0].finish_reason == "abort"
            before = seen[1].outputs[0].token_ids
            assert last.outputs[0].token_ids[: len(before)] == before
            assert not any(o.finished for o in seen[:-1])
            assert await engine.abort("a") is False  # no longer known
            assert await engine.abort("never") is False
            with pytest.raises(TypeError, match="request_id"):
                await engine.abort(5)  # type: ignore[arg-type]
            await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 1)

    run(main())


def test_duplicate_request_id(llm: LLM) -> None:
    reference = llm.generate("Hello", GREEDY, use_tqdm=False)[0]

    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            first = engine.generate("Hello", GREEDY, "dup")
            outputs = [await anext(first)]
            with pytest.raises(ValueError, match="'dup' is in use"):
                await anext(engine.generate("Bye", GREEDY, "dup"))
            outputs += [o async for o in first]  # the first request is unharmed
            check_stream(outputs, reference, "dup")
            check_stream(await collect(engine, "Hello", GREEDY, "dup"), reference, "dup")  # free once finished

    run(main())


def bad_inputs() -> list[tuple[Any, Any]]:
    changed = SamplingParams()
    changed.max_tokens = 0  # changed after it was checked: checked again
    return [
        ("Hello", "greedy"),
        (123, GREEDY),
        ({"prompt_token_ids": []}, GREEDY),
        ({"prompt_token_ids": [10**6]}, GREEDY),
        ({"prompt_token_ids": [1] * 5000}, GREEDY),
        ("Hello", changed),
    ]


def test_bad_input_raises_before_anything_is_queued(llm: LLM) -> None:
    expected = []
    for prompt, params in bad_inputs():  # what LLM.add_request says (it queues nothing either)
        with pytest.raises((TypeError, ValueError)) as info:
            llm.add_request(prompt, params)
        expected.append((info.type, str(info.value)))

    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            for (prompt, params), (error_type, message) in zip(bad_inputs(), expected):
                with pytest.raises(error_type) as info:
                    await anext(engine.generate(prompt, params, "bad"))
                assert str(info.value) == message
            with pytest.raises(TypeError, match="request_id"):
                await anext(engine.generate("Hello", GREEDY, 7))  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
            assert engine.stats.num_steps == llm.stats.num_steps
            assert engine.stats.num_requests_finished == engine.stats.num_requests_aborted == 0

    run(main())


def test_request_that_fails_in_the_engine_ends_with_error(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    add_request = llm.add_request

    def add_or_fail(prompt: Any, params: SamplingParams) -> str:
        if prompt == "poison":
            raise MemoryError("no room for it")
        return add_request(prompt, params)

    monkeypatch.setattr(llm, "add_request", add_or_fail)

    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            failed, ok = await asyncio.gather(
                collect(engine, "poison", GREEDY, "p"), collect(engine, "Hello", GREEDY, "h")
            )
            check_stream(ok, reference, "h")
            [output] = failed
            assert output.finished and output.outputs[0].finish_reason == "error"
            assert output.error == "MemoryError: no room for it"
            assert engine.is_running  # the loop goes on
            check_stream(await collect(engine, "Hello", GREEDY, "again"), reference, "again")

    run(main())


def test_request_failing_in_a_step_ends_with_error_and_the_loop_goes_on(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = [9, 9, 9]
    reference = llm.generate(["Hello", {"prompt_token_ids": poison}], GREEDY, use_tqdm=False)
    check_stop = Request.check_stop

    def failing(request: Request, max_model_len: int) -> bool:  # while its third token is booked
        if request.prompt_token_ids == poison and len(request.output_token_ids) == 3:
            raise RuntimeError("booking failed")
        return check_stop(request, max_model_len)

    monkeypatch.setattr(Request, "check_stop", failing)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        async with AsyncLLM.from_llm(llm) as engine:
            results = await asyncio.gather(
                collect(engine, "Hello", GREEDY, "h"), collect(engine, {"prompt_token_ids": poison}, GREEDY, "p")
            )
            assert engine.is_running
            check_stream(await collect(engine, "Hello", GREEDY, "again"), reference[0], "again")
            return results

    ok, failed = run(main())
    check_stream(ok, reference[0], "h")
    last = failed[-1]
    assert last.finished and last.outputs[0].finish_reason == "error" and "booking failed" in (last.error or "")
    assert last.outputs[0].token_ids == reference[1].outputs[0].token_ids[:3]  # its tokens booked before it


def test_step_failure_fails_every_pending_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    step = llm.step
    calls = 0

    def step_then_fail() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("boom in the forward")
        return step()

    monkeypatch.setattr(llm, "step", step_then_fail)

    async def main() -> None:
        engine = AsyncLLM.from_llm(llm)
        results = await asyncio.gather(
            *(collect(engine, "Hello", LONG, f"x{i}") for i in range(3)), return_exceptions=True
        )
        for error in results:
            assert isinstance(error, EngineDeadError), error
            assert "stopped on RuntimeError: boom in the forward" in str(error)
            assert isinstance(error.__cause__, RuntimeError)
        assert not engine.is_running and not engine.stats.alive
        with pytest.raises(EngineDeadError, match="boom in the forward"):
            await anext(engine.generate("Hello", GREEDY, "later"))
        assert await engine.abort("x0") is False
        engine.shutdown()

    run(main(), timeout=10)
    assert calls == 4  # it stopped at the first failure


def test_shutdown_with_requests_in_flight(llm: LLM) -> None:
    async def main() -> float:
        engine = AsyncLLM.from_llm(llm)
        streams = [engine.generate("Hello", LONG, f"s{i}") for i in range(4)]
        for stream in streams:
            await anext(stream)
        start = time.monotonic()
        engine.shutdown()
        took = time.monotonic() - start
        for stream in streams:
            with pytest.raises(EngineDeadError, match="shut down"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(engine.generate("Hello", GREEDY))
        engine.shutdown()  # again: nothing happens
        return took

    assert run(main()) < 1.0


def test_ctrl_c_leaves_the_engine_consistent(llm: LLM) -> None:
    reference = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    engine = AsyncLLM.from_llm(llm)

    async def interrupted() -> None:
        async for _ in engine.generate("Hello", LONG, "k"):
            signal.raise_signal(signal.SIGINT)  # asyncio.run cancels this task, then raises KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(interrupted())

    async def after() -> None:
        await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 1)
        check_stream(await collect(engine, "Hello", GREEDY, "k"), reference, "k")

    run(after())
    engine.shutdown()


def test_idle_engine_sleeps(llm: LLM) -> None:
    async def main() -> None:
        async with AsyncLLM.from_llm(llm) as engine:
            await collect(engine, "Hello", GREEDY, "warm")
            steps, cpu = engine.stats.num_steps, time.process_time()
            await asyncio.sleep(0.3)
            assert time.process_time() - cpu < 0.05  # a spinning loop would take the whole 0.3 s
            assert engine.stats.num_steps == steps

    run(main())


def test_stats_snapshot(llm: LLM) -> None:
    prefix = [(3 * j) % 250 + 1 for j in range(40)]  # two full blocks of 16 that the requests share
    held: dict[int, tuple[int, set[int], int]] = {}
    """Step number -> requests in it, the blocks they hold (their block tables, read by a step listener), and
    the sum of their table lengths."""

    def record(event: StepEvent) -> None:
        rows = [row for tables in event.block_ids.values() for row in tables]
        held[event.step] = (len(event.block_ids), {b for row in rows for b in row} - {0}, sum(map(len, rows)))

    async def main() -> tuple[EngineSnapshot, EngineSnapshot]:
        async with AsyncLLM.from_llm(llm) as engine:
            await collect(engine, {"prompt_token_ids": prefix + [7]}, GREEDY, "p1")
            streams = [engine.generate({"prompt_token_ids": prefix + [8 + i]}, LONG, f"l{i}") for i in range(2)]
            for stream in streams:
                await anext(stream)
            running = engine.stats
            for stream in streams:
                await stream.aclose()
            return running, await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 2)

    detach = llm.add_step_listener(record)
    try:
        running, done = run(main())
    finally:
        detach()
    num_requests, blocks, table_lengths = held[running.num_steps]  # the snapshot is of that step
    assert (running.num_requests_running, running.num_requests_waiting) == (num_requests, 0) == (2, 0)
    assert round(running.kv_cache_usage * llm.kv_cache_manager.num_usable_blocks) == len(blocks)
    assert table_lengths - len(blocks) == 2  # the prefix blocks are held once
    assert done.num_requests_finished == 1 and done.alive
    assert done.prefix_cache_hit_rate == llm.stats.prefix_cache_hit_rate > 0
    assert (done.num_prefix_cache_hits, done.num_prefix_cache_queries) == (
        llm.stats.num_cached_tokens,
        llm.stats.num_lookup_tokens,
    )
    assert (done.num_steps, done.num_decode_tokens) == (llm.stats.num_steps, llm.stats.num_decode_tokens)


def test_fold_output() -> None:
    def child(index: int, text: str, reason: str | None, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(index, text, [ord(c) for c in text], reason)
        return RequestOutput("r", "p", [1], [completion], finished=finished)

    merged = None
    for output in [child(1, "b", None), child(0, "a", None), child(1, "bc", "length"), child(0, "ad", "stop", True)]:
        merged = fold_output(merged, output)
    assert merged is not None and merged.finished
    assert [(c.index, c.text, c.finish_reason) for c in merged.outputs] == [(0, "ad", "stop"), (1, "bc", "length")]
    assert fold_output(None, child(0, "a", None)).outputs[0].text == "a"


def test_n_outputs_stream_one_child_at_a_time(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)
    reference = llm.generate("Hello", params, use_tqdm=False)[0]
    if len(reference.outputs) != 3:
        pytest.skip("LLM does not fan out n > 1 yet (issue 47, must-deliver 1)")

    async def main() -> list[RequestOutput]:
        async with AsyncLLM.from_llm(llm) as engine:
            return await collect(engine, "Hello", params, "n3")

    outputs = run(main())
    merged = None
    for output in outputs:
        merged = fold_output(merged, output)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert merged is not None
    assert [c.token_ids for c in merged.outputs] == [c.token_ids for c in reference.outputs]
    assert [c.index for c in merged.outputs] == [0, 1, 2]


def test_owns_its_llm_and_refuses_a_busy_one() -> None:
    async def main() -> None:
        async with AsyncLLM("tiny", device="cpu", num_kv_blocks=16, block_size=4) as engine:
            tokenizer = engine.get_tokenizer()
            assert tokenizer is engine.llm.tokenizer
            [*_, last] = await collect(engine, "Hi", GREEDY, "t")
            assert last.outputs[0].text == tokenizer.decode(last.outputs[0].token_ids)
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(engine.generate("Hi", GREEDY))

    run(main())
    busy = LLM("tiny", device="cpu", num_kv_blocks=16, block_size=4)
    busy.add_request("Hi", GREEDY)
    with pytest.raises(ValueError, match="idle LLM"):
        AsyncLLM.from_llm(busy)
    with pytest.raises(TypeError, match="takes an LLM"):
        AsyncLLM.from_llm("tiny")  # type: ignore[arg-type]


def test_aborted_n_request_ends_every_child(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=1000, ignore_eos=True)

    async def main() -> list[RequestOutput]:
        async with AsyncLLM.from_llm(llm) as engine:
            outputs = []
            async for output in engine.generate("Hello", params, "n2"):
                outputs.append(output)
                if len(outputs) == 3:
                    assert await engine.abort("n2") is True
            await wait_until(engine, lambda s: engine_idle(s) and s.num_requests_aborted == 1)
            return outputs

    outputs = run(main())
    if outputs[0].outputs[0].finish_reason == "abort" and len(outputs[0].outputs) == 1:
        pytest.skip("LLM does not fan out n > 1 yet (issue 47, must-deliver 1)")
    *streamed, last = outputs
    merged = None
    for output in streamed:
        merged = fold_output(merged, output)
    assert merged is not None
    latest = {c.index: c.token_ids for c in merged.outputs}
    assert last.finished and [c.index for c in last.outputs] == [0, 1]
    assert [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    # Its tokens so far are kept (the last output may hold some the loop had not yielded yet).
    assert all(last.outputs[i].token_ids[: len(tokens)] == tokens for i, tokens in latest.items())


def test_callers_on_two_event_loops(llm: LLM) -> None:
    """Two threads, each with its own asyncio.run, share one engine: each gets its own outputs."""
    prompts = [f"Thread {i} says" for i in range(6)]
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = AsyncLLM.from_llm(llm)
    results: dict[int, list[list[RequestOutput]]] = {}

    def caller(half: int) -> None:
        async def main() -> list[list[RequestOutput]]:
            return await asyncio.gather(*(collect(engine, prompts[i], GREEDY, f"t{i}") for i in range(half, 6, 2)))

        results[half] = run(main())

    threads = [threading.Thread(target=caller, args=(half,)) for half in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    engine.shutdown()
    for half in (0, 1):
        for i, outputs in zip(range(half, 6, 2), results[half]):
            check_stream(outputs, reference[i], f"t{i}")


def test_abort_before_the_first_output(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Added and aborted between the same two steps: the last output is the only one, every child empty."""
    step, held, go = llm.step, threading.Event(), threading.Event()

    def held_step() -> list[RequestOutput]:
        held.set()
        go.wait(10)  # the engine thread waits here while the request is added and aborted
        return step()

    monkeypatch.setattr(llm, "step", held_step)
    params = SamplingParams(n=2, max_tokens=4)

    async def main() -> list[RequestOutput]:
        async with AsyncLLM.from_llm(llm) as engine:
            keep_busy = asyncio.create_task(collect(engine, "Hello", GREEDY, "busy"))
            while not held.is_set():  # its step is held
                await asyncio.sleep(0.002)
            early = asyncio.create_task(collect(engine, {"prompt_token_ids": [4, 5]}, params, "early"))
            aborted = asyncio.create_task(engine.abort("early"))
            await asyncio.sleep(0.05)  # both handed over
            go.set()
            assert await aborted is True
            await keep_busy
            return await early

    [last] = run(main())
    assert last.finished and last.request_id == "early" and last.prompt_token_ids == [4, 5]
    assert [(c.index, c.token_ids, c.finish_reason) for c in last.outputs] == [(0, [], "abort"), (1, [], "abort")]
