"""The batch-invariant mode (`LLM(batch_invariant=True)`): one request's logits are bitwise the same
alone, in batches of 2-64 other requests, chunked at other budgets, after a prefix-cache hit and
after preemption (CPU, float32 and bf16, TORCH_REF and TRITON_ATTN). With the mode off the same
comparisons differ, so these tests can tell the two apart."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedkv import LLM, SamplingParams, batch_invariant
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import register_backend, unregister_backend
from pagedkv.engine import arg_utils
from pagedkv.engine.events import StepEvent
from pagedkv.engine.request import RequestStatus
from tests.conftest import needs_triton_on_cpu

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TARGET = [(37 * j) % 300 + 3 for j in range(40)]
"""The request whose logits are compared; 40 tokens: several blocks of 16, so a prefix can be cached."""


def others(n: int, seed: int = 1) -> list[list[int]]:
    """n other prompts of varied lengths (3-60 tokens), random ids, deterministic."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 61))] for _ in range(n)]


def target_logits(
    llm: LLM, batch: list[list[int]], warm: list[list[int]] | None = None, batch_tokens: int = 4
) -> list[torch.Tensor]:
    """The logits TARGET sampled from, step by step, when it runs with `batch` (queued first, so they
    are scheduled before it, each generating `batch_tokens`); `warm` runs before, on its own (to fill
    the prefix cache). `llm.resumed` counts the target's resumptions after a preemption."""
    if warm:
        llm.generate([{"prompt_token_ids": p} for p in warm], GREEDY)
    rows: list[torch.Tensor] = []

    def listen(event: StepEvent) -> None:
        sampling = [s for s in event.scheduler_output.scheduled if s.samples]
        for s, row in zip(sampling, event.result.logits, strict=True):
            if s.request.request_id == target_id:
                rows.append(row.detach().clone())
        llm.resumed += any(  # type: ignore[attr-defined]
            s.request.request_id == target_id and s.admitted_from is RequestStatus.PREEMPTED
            for s in event.scheduler_output.scheduled
        )

    llm.resumed = 0  # type: ignore[attr-defined]
    detach = llm.add_step_listener(listen)
    try:
        for p in batch:
            llm.add_request(
                {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=batch_tokens, ignore_eos=True)
            )
        target_id = llm.add_request({"prompt_token_ids": TARGET}, GREEDY)
        while llm.has_unfinished_requests():
            llm.step()
    finally:
        detach()
    assert len(rows) == GREEDY.max_tokens
    return rows


def differing_steps(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))


def assert_same_model(invariant: list[torch.Tensor], default: list[torch.Tensor]) -> None:
    """The mode computes the same model (equal bits are not enough: attention that outputs zeros is
    invariant too): the logits agree with the default mode's to rounding, and so do the greedy tokens."""
    for a, b in zip(invariant, default, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.float().abs().max().item())
        assert a.argmax() == b.argmax()


def engine(backend: str, dtype: str, invariant: bool, model: str = "tiny", **kwargs: object) -> LLM:
    return LLM(model, attention_backend=backend, dtype=dtype, batch_invariant=invariant, seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_ref_logits_are_bitwise_the_same_in_any_batch(dtype: str) -> None:
    llm = engine("TORCH_REF", dtype, True, enable_prefix_caching=False, max_num_seqs=64)
    alone = target_logits(llm, [])
    assert_same_model(alone, target_logits(engine("TORCH_REF", dtype, False, enable_prefix_caching=False), []))
    for n in (1, 7, 63):
        assert differing_steps(alone, target_logits(llm, others(n, seed=n))) == 0, f"in a batch of {n + 1}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_ref_logits_survive_chunking_caching_and_preemption(dtype: str) -> None:
    alone = target_logits(engine("TORCH_REF", dtype, True, enable_prefix_caching=False), [])
    for budget in (7, 16, 33):  # prompts cut into chunks at other places
        chunked = engine("TORCH_REF", dtype, True, enable_prefix_caching=False, max_num_batched_tokens=budget)
        assert differing_steps(alone, target_logits(chunked, others(5))) == 0, f"chunked at {budget} tokens"
    cached = engine("TORCH_REF", dtype, True, enable_prefix_caching=True)
    before = cached.stats.num_cached_tokens
    hit = target_logits(cached, others(3), warm=[TARGET[:33] + [5, 6]])
    assert cached.stats.num_cached_tokens - before >= 32, "the target's first two blocks came from the cache"
    assert differing_steps(alone, hit) == 0
    # 9 usable blocks of 16 tokens admit the target (3 blocks) and four 16-token prompts, but not their
    # growth to 36 tokens: the last admitted, the target, is preempted, then recomputed.
    tight = engine("TORCH_REF", dtype, True, enable_prefix_caching=False, num_kv_blocks=10)
    preempted = target_logits(tight, [[7 + i] * 16 for i in range(4)], batch_tokens=20)
    assert tight.resumed > 0  # type: ignore[attr-defined]
    assert differing_steps(alone, preempted) == 0


@pytest.mark.slow
@needs_triton_on_cpu("TRITON_ATTN")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_attn_logits_are_bitwise_the_same_in_any_batch(dtype: str) -> None:
    """TRITON_ATTN (here in Triton's interpreter): a batch of 8, chunking and a prefix-cache hit."""
    alone = target_logits(engine("TRITON_ATTN", dtype, True, enable_prefix_caching=False, max_num_seqs=8), [])
    assert_same_model(alone, target_logits(engine("TORCH_REF", dtype, False, enable_prefix_caching=False), []))
    batched = engine("TRITON_ATTN", dtype, True, enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=24)
    assert differing_steps(alone, target_logits(batched, others(7))) == 0
    assert differing_steps(alone, target_logits(batched, others(3, seed=9), warm=[TARGET[:20]])) == 0
    assert batched.stats.num_cached_tokens >= 16


@pytest.mark.parametrize("invariant", [True, False])
def test_an_fp8_cache_keeps_the_mode(invariant: bool) -> None:
    """With an fp8 KV cache (TORCH_REF): quantizing is one rounding per value with the layer's fixed
    scales, so with the mode the target's logits stay bitwise the same in a batch of 64 and after a
    prefix-cache hit, and it computes the fp8-cache model; without it the batch changes them."""
    llm = engine("TORCH_REF", "float32", invariant, kv_cache_dtype="fp8", max_num_seqs=64)
    assert llm.runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype == torch.float8_e4m3fn
    alone = target_logits(llm, [])
    if not invariant:
        assert differing_steps(alone, target_logits(llm, others(63))) > 0
        return
    assert_same_model(alone, target_logits(engine("TORCH_REF", "float32", False, kv_cache_dtype="fp8"), []))
    assert differing_steps(alone, target_logits(llm, others(63))) == 0
    before = llm.stats.num_cached_tokens
    assert differing_steps(alone, target_logits(llm, others(2, seed=5), warm=[TARGET[:33] + [8]])) == 0
    assert llm.stats.num_cached_tokens - before >= 32


@pytest.mark.parametrize("pieces", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_mode_keeps_the_bits(pieces: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=True with the mode: its matmul and norm are opaque ops (pagedkv/library.py), so the
    compiled pieces (on the CPU Dynamo's graph run as it is, or Inductor's C++, ~20 s) fuse only
    elementwise work around them. The target's float32 logits (where a batch of 64 changes the CPU's
    matmuls) stay bitwise the same in a batch of 64, chunked and after a prefix-cache hit, and the
    model is the same as without the mode."""
    check = arg_utils.check_compilation
    monkeypatch.setattr(
        arg_utils, "check_compilation", lambda *a, **k: dataclasses.replace(check(*a, **k), piece_compiler=pieces)
    )
    llm = engine("TORCH_REF", "float32", True, compile=True, max_num_seqs=64)
    assert llm.runner.compiled_forward is not None
    alone = target_logits(llm, [])
    assert_same_model(alone, target_logits(engine("TORCH_REF", "float32", False, enable_prefix_caching=False), []))
    assert differing_steps(alone, target_logits(llm, others(63))) == 0
    chunked = engine("TORCH_REF", "float32", True, compile=True, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert differing_steps(alone, target_logits(chunked, others(5))) == 0, "chunked at 7 tokens"
    before = llm.stats.num_cached_tokens
    assert differing_steps(alone, target_logits(llm, others(2, seed=5), warm=[TARGET[:33] + [8]])) == 0
    assert llm.stats.num_cached_tokens - before >= 32


SAMPLED = SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=7, logprobs=5, max_tokens=6, ignore_eos=True)


def sampled_output(llm: LLM, n_others: int) -> tuple[list[int], list[dict[int, float]]]:
    """A seeded top-p / top-k request's tokens and logprobs, run after `n_others` requests that sample
    with parameters of their own (so the sampler's batch mixes temperatures, top-p and greedy rows)."""
    for i, p in enumerate(others(n_others, seed=3)):
        params = SamplingParams(temperature=[0.0, 1.0, 0.5][i % 3], top_p=0.95, seed=i, max_tokens=5, ignore_eos=True)
        llm.add_request({"prompt_token_ids": p}, params)
    target = llm.add_request({"prompt_token_ids": TARGET}, SAMPLED)
    finals = {}
    while llm.has_unfinished_requests():
        finals.update({out.request_id: out for out in llm.step() if out.finished})
    completion = finals[target].outputs[0]
    return list(completion.token_ids), list(completion.logprobs)


@pytest.mark.parametrize(("dtype", "invariant"), [("bfloat16", True), ("float32", False)])
def test_sampled_tokens_and_logprobs_the_same_in_any_batch(dtype: str, invariant: bool) -> None:
    """The sampler too (softmax, top-p, log-softmax): with the mode, a seeded sampled request gets the
    same tokens and bitwise the same logprobs alone and among 15 others; without it (float32), the
    logprobs differ, so the comparison can tell."""
    llm = engine("TORCH_REF", dtype, invariant, enable_prefix_caching=False, max_num_seqs=16)
    alone, batched = sampled_output(llm, 0), sampled_output(llm, 15)
    if invariant:
        assert alone == batched
    else:
        assert alone[1] != batched[1]


def test_the_same_comparisons_differ_with_the_mode_off() -> None:
    """Without the mode, a batch changes the target's float32 logits (CPU matmuls pick kernels by the
    number of rows): so the tests above would catch a mode that did nothing."""
    off = engine("TORCH_REF", "float32", False, enable_prefix_caching=False, max_num_seqs=64)
    assert differing_steps(target_logits(off, []), target_logits(off, others(63))) > 0


def test_row_blocks_keep_a_row_the_same_whatever_the_batch() -> None:
    """The kernels themselves, against float64: right values, and a row's bits independent of its batch."""
    torch.manual_seed(0)
    x, w, g = torch.randn(70, 96), torch.randn(80, 96), torch.randn(96)
    full = batch_invariant.linear(x, w)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * g.double()
    torch.testing.assert_close(batch_invariant.rms_norm(x, g, 1e-6).double(), ref, rtol=1e-5, atol=1e-5)
    for m in (1, 5, 16, 17, 33):
        assert torch.equal(batch_invariant.linear(x[:m], w), full[:m])
        assert torch.equal(
            batch_invariant.rms_norm(x[3 : 3 + m], g, 1e-6), batch_invariant.rms_norm(x, g, 1e-6)[3 : 3 + m]
        )


def test_a_backend_without_batch_invariance_is_refused_at_start_up() -> None:
    class SplitKVRef(TorchRefBackend):
        @staticmethod
        def get_name() -> str:
            return "SPLIT_KV_REF"

        @classmethod
        def supports_batch_invariance(cls) -> bool:
            return False

    register_backend(SplitKVRef)
    try:
        with pytest.raises(RuntimeError, match="SPLIT_KV_REF does not support batch invariance"):
            LLM("tiny", attention_backend="SPLIT_KV_REF", batch_invariant=True)
        LLM("tiny", attention_backend="SPLIT_KV_REF")  # without the mode it serves
    finally:
        unregister_backend("SPLIT_KV_REF")
