"""The engine end to end on the CPU: scheduling, preemption, hybrid groups, sampling, errors, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.engine.request import RequestOutput
from tests.reference import generate_checked

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts(lengths: list[int]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [(11 * i + j) % 250 + 1 for j in range(n)]} for i, n in enumerate(lengths)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


CHUNKED_PROMPTS = prompts([5, 60, 3])
PREEMPTED_PROMPTS = prompts([9, 14, 6, 11])
HYBRID_PROMPTS = prompts([70])


# The scenarios take the backend as an argument: tests/attention/test_broken_backends.py runs them with
# broken backends to show that their checks (logits against the float64 reference) catch those.


def run_chunked_and_whole(backend: str = "TORCH_REF") -> tuple[LLM, list[StepEvent], list[RequestOutput]]:
    """A 60-token prompt in chunks under a 24-token budget, and whole: both match the reference."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=24, attention_backend=backend)
    events: list[StepEvent] = []
    llm.add_step_listener(events.append)
    outs = generate_checked(llm, CHUNKED_PROMPTS, GREEDY)
    whole = LLM("tiny", device="cpu", num_kv_blocks=64, attention_backend=backend)
    assert tokens(outs) == tokens(generate_checked(whole, CHUNKED_PROMPTS, GREEDY))
    return llm, events, outs


def run_preemption(backend: str = "TORCH_REF") -> LLM:
    """Four requests in 8 usable blocks of 4 tokens (preempted, recomputed), and in a roomy cache."""
    roomy = LLM("tiny", device="cpu", num_kv_blocks=64, block_size=4, attention_backend=backend)
    tight = LLM("tiny", device="cpu", num_kv_blocks=9, block_size=4, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = tokens(generate_checked(tight, PREEMPTED_PROMPTS, params))
    assert got == tokens(generate_checked(roomy, PREEMPTED_PROMPTS, params)) and all(len(t) == 10 for t in got)
    return tight


def run_hybrid_small_cache(backend: str = "TORCH_REF") -> tuple[LLM, list[StepEvent], list[RequestOutput]]:
    """tiny-hybrid on 70 + 20 tokens, with a roomy cache, then half the cache and a 16-token budget."""
    llm = LLM("tiny-hybrid", device="cpu", num_kv_blocks=64, block_size=8, attention_backend=backend)
    events: list[StepEvent] = []
    llm.add_step_listener(events.append)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = generate_checked(llm, HYBRID_PROMPTS, params)
    small = LLM(
        "tiny-hybrid",
        device="cpu",
        num_kv_blocks=14,
        block_size=8,
        max_num_batched_tokens=16,
        attention_backend=backend,
    )
    assert tokens(generate_checked(small, HYBRID_PROMPTS, params)) == tokens(out)
    return llm, events, out


def test_chunked_prefill_and_decode_first() -> None:
    llm, events, _ = run_chunked_and_whole()
    for e in events:
        kinds = [s.is_decode for s in e.scheduler_output.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes must come first"
        assert e.scheduler_output.num_scheduled_tokens <= 24
    assert any(e.scheduler_output.num_decode_tokens and e.scheduler_output.num_prefill_tokens for e in events), (
        "expected at least one mixed prefill + decode step"
    )
    assert llm.stats.num_prefill_tokens == 68 and llm.stats.num_decode_tokens == 3 * 5


def test_preemption_recomputes_and_loses_nothing() -> None:
    tight = run_preemption()
    assert tight.stats.num_preemptions > 0
    assert tight.kv_cache_manager.num_free_blocks() == 8


@pytest.mark.parametrize("num_kv_blocks, budget", [(9, 2048), (11, 6)])
def test_a_preempted_request_goes_first_in_line_and_no_one_is_admitted_in_its_step(
    num_kv_blocks: int, budget: int
) -> None:
    """vLLM's policy: the victim (the newest running request) waits at the front of the queue, and
    a step that had to preempt admits no waiting request (it would only be preempted in turn)."""
    llm = LLM(
        "tiny",
        device="cpu",
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        attention_backend="TORCH_REF",
    )
    preempting: list[int] = []

    def check(event: StepEvent) -> None:
        victims = event.scheduler_output.preempted_req_ids
        if victims:
            preempting.append(event.step)
            assert llm.scheduler.waiting[0].request_id == victims[-1]
            assert all(s.num_lookup_tokens == 0 for s in event.scheduler_output.scheduled), "admitted in the step"

    llm.add_step_listener(check)
    llm.generate(PREEMPTED_PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert preempting


def test_a_request_fits_when_its_tokens_up_to_max_model_len_do() -> None:
    """max_tokens=100 would overflow 4 blocks of 4, but max_model_len=16 ends the request first."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=5, block_size=4, max_model_len=16)
    out = llm.generate(prompts([4]), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_without_chunking_a_prompt_of_exactly_the_remaining_budget_runs_now() -> None:
    # The plan of the step after an add_request: async scheduling would have planned that step
    # already, in the call before the add (tests/engine/test_async_scheduling.py).
    llm = LLM(
        "tiny",
        device="cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_model_len=16,
        enable_chunked_prefill=False,
        async_scheduling=False,
    )
    llm.add_request(prompts([4])[0], GREEDY)
    llm.step()  # request 0 prefilled; from now on it decodes, 1 token a step
    llm.add_request(prompts([1, 15])[1], GREEDY)  # 15 tokens: exactly what the decode leaves
    llm.step()
    assert llm.stats.num_prefill_tokens == 4 + 15


def test_hybrid_model_has_two_groups_and_matches_with_small_cache() -> None:
    llm, events, _ = run_hybrid_small_cache()
    groups = llm.runner.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    assert sorted(len(g.layer_names) for g in groups) == [2, 2]
    # Late in the run, the sliding-window group's row starts with null blocks; the full one does not.
    rows = events[-1].block_ids["0"]
    window_group = next(i for i, g in enumerate(groups) if hasattr(g.kv_cache_spec, "sliding_window"))
    assert rows[window_group][0] == 0 and 0 not in rows[1 - window_group]
    # One metadata object per attention group, shared by its layers.
    metadata = events[-1].result.attn_metadata
    for attn_group in [g for gs in llm.runner.attn_groups for g in gs]:
        assert len({id(metadata[n]) for n in attn_group.layer_names}) == 1
    assert len({id(m) for m in metadata.values()}) == 2


def test_stop_conditions() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=32)
    free = tokens(llm.generate(prompts([4]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))[0]
    stop_at = free[3]
    for ignore_eos in (False, True):  # ignore_eos concerns the model's EOS ids only, not stop_token_ids
        params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=ignore_eos)
        out = llm.generate(prompts([4]), params)[0]
        assert out.outputs[0].token_ids == free[: free.index(stop_at) + 1]
        assert out.outputs[0].finish_reason == "stop"
    eos = LLM("tiny", device="cpu", num_kv_blocks=32)
    eos.eos_token_ids = [free[1]]
    eos_out = eos.generate(prompts([4]), SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert eos_out.token_ids == free[: free.index(free[1]) + 1] and eos_out.finish_reason == "stop"
    capped = LLM("tiny", device="cpu", num_kv_blocks=32, max_model_len=7)
    out = capped.generate(prompts([4]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


def test_sampling_seed_top_k_top_p() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=64)
    hot = SamplingParams(temperature=5.0, max_tokens=12, seed=7, ignore_eos=True)
    a = tokens(llm.generate(prompts([3, 3]), [hot, hot]))
    b = tokens(llm.generate(prompts([3, 3]), [hot, hot]))
    assert a == b, "a seed must make sampling reproducible"
    other = tokens(llm.generate(prompts([3]), SamplingParams(temperature=5.0, max_tokens=12, seed=8, ignore_eos=True)))
    assert other[0] != a[0]
    greedy = tokens(llm.generate(prompts([3]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    top1 = tokens(
        llm.generate(prompts([3]), SamplingParams(temperature=5.0, top_k=1, max_tokens=12, seed=1, ignore_eos=True))
    )
    tiny_p = tokens(
        llm.generate(prompts([3]), SamplingParams(temperature=5.0, top_p=1e-6, max_tokens=12, seed=1, ignore_eos=True))
    )
    assert top1 == greedy == tiny_p


def test_uniform_decode_steps_are_the_steps_of_one_token_per_request() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=24, attention_backend="TORCH_REF")
    flags: list[tuple[bool, bool]] = []
    llm.add_step_listener(
        lambda e: flags.append(
            (e.result.batch_descriptor.uniform_decode, all(s.num_new_tokens == 1 for s in e.scheduler_output.scheduled))
        )
    )
    llm.generate(CHUNKED_PROMPTS, GREEDY)
    assert all(got == expected for got, expected in flags) and {e for _, e in flags} == {True, False}


def test_clear_errors() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=5, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt of 64 tokens does not fit max_model_len=64"):
        llm.generate(prompts([64]), GREEDY)
    with pytest.raises(ValueError, match=r"need 5 KV cache blocks, but the cache has only 4\. Use num_kv_blocks >= 6"):
        llm.generate(prompts([14]), GREEDY)
    with pytest.raises(ValueError, match="has no matching|neither a preset"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match=r"top_p must be .*in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="'prompt_token_ids'"):
        llm.generate({"tokens": [1]})
    with pytest.raises(ValueError, match="at least 2 are needed"):
        LLM("tiny", device="cpu", num_kv_blocks=1)
    with pytest.raises(ValueError, match=r"Prompt token ids must be in \[0, 320\)"):
        llm.generate({"prompt_token_ids": [999]})


def test_string_prompts_and_text() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=32)
    out = llm.generate(["Hello", "paged"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.prompt for o in out] == ["Hello", "paged"]
    assert out[0].prompt_token_ids == [256, *b"Hello"]
    assert out[0].outputs[0].text == llm.tokenizer.decode(out[0].outputs[0].token_ids)


def test_cli_generate_show_steps() -> None:
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "hi there",
        "--max-tokens",
        "4",
        "--show-steps",
        "--num-kv-blocks",
        "16",
        "--device",
        "cpu",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["step", "reqs", "prefill", "cached", "decode", "blocks", "used/free", "preempt"]
    assert lines[1].split()[:5] == ["1", "1", "9", "0", "0"]  # BOS + 8 bytes of prefill in step 1, none cached
    assert len(lines) == 1 + 4 + 1  # header, 4 steps, the text
    assert "4 steps" in done.stderr


def test_cli_backends_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "backends", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "TORCH_REF" in done.stdout and "FLASH_ATTN" in done.stdout
    fp8 = subprocess.run(
        [sys.executable, "-m", "pagedkv", "backends", "--device", "cpu", "--kv-cache-dtype", "fp8"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "KV cache torch.float8_e4m3fn" in fp8 and "Blackwell" in fp8  # FLASH_ATTN's fp8 reason
    assert fp8.splitlines()[1].split() == ["TORCH_REF", "ok"]


def test_one_token_prompt_counts_as_prefill() -> None:
    """Phases are fixed when a step is planned, so a 1-token prompt's step stays a prefill."""
    llm = LLM("tiny", device="cpu", num_kv_blocks=8)
    llm.generate({"prompt_token_ids": [5]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert (llm.stats.num_prefill_tokens, llm.stats.num_decode_tokens) == (1, 2)
