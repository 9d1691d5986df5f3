"""A request over an fp8 KV cache, alone and in a random batch: with `batch_invariant=True` its tokens
and logprobs are the same; without it its float32 logprobs move with the batch.

The fp8 cache rounds each K and V once, when it is written, with the layer's fixed scales, so the
stored bytes do not depend on the batch; what does is every reduction around them (matmuls, attention,
softmax), which the batch-invariant mode fixes (pagedkv/batch_invariant.py; vLLM's
VLLM_BATCH_INVARIANT, vllm/model_executor/layers/batch_invariant.py). Chunked prefill, prefix caching
and async scheduling are off, so the batch is the only thing that differs. On this repository's CPU,
tiny's greedy tokens did not differ without the mode in any of 60 such workloads (its logprobs did
in all 60), so only the logprobs' difference is asserted there.
"""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, SamplingParams
from tests.engine.test_batch_invariant import engine, others

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
SEEDS = range(6)


def workload(seed: int) -> tuple[list[int], list[list[int]], int]:
    """A random target prompt (3-60 tokens), 1-31 other prompts (`others`), and where the target
    sits among them."""
    rng = random.Random(seed)
    target = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 61))]
    batch = others(rng.randrange(1, 32), seed=seed)
    return target, batch, rng.randrange(len(batch) + 1)


def tokens_and_logprobs(llm: LLM, prompts: list[list[int]], index: int) -> tuple[list[int], list[dict[int, float]]]:
    """The greedy tokens and logprobs of `prompts[index]`, all of `prompts` run together."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    completion = outs[index].outputs[0]
    return list(completion.token_ids), list(completion.logprobs)


@pytest.mark.parametrize("invariant", [True, False])
def test_an_fp8_request_alone_and_in_a_random_batch(invariant: bool) -> None:
    llm = engine(
        "TORCH_REF",
        "float32",
        invariant,
        kv_cache_dtype="fp8",
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        async_scheduling=False,
        max_num_seqs=32,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    differing_logprobs = 0
    for seed in SEEDS:
        target, batch, at = workload(seed)
        alone = tokens_and_logprobs(llm, [target], 0)
        among = tokens_and_logprobs(llm, [*batch[:at], target, *batch[at:]], at)
        if invariant:
            assert among == alone, f"workload {seed}: {len(batch)} others, the target at {at}"
        differing_logprobs += among[1] != alone[1]
    if not invariant:
        assert differing_logprobs > 0  # so the comparison above can tell the modes apart
