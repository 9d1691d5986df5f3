"""Speculative decoding on a CUDA GPU (issue 34, point 4).

1. Uniform decode steps of 1 + k query tokens per request replay FULL graphs (keys at multiples of
   1 + k, so none falls back), and give the eager engine's tokens; float32 greedy output equals the
   engine without speculation.
2. TRITON_MLA declares UNIFORM_SINGLE_TOKEN_DECODE: the decode-query-length rule lowers its FULL
   decode graphs when k > 0, the engine says so, and its output is still the non-speculative one.

Each backend's graphs of such batches are also captured once and replayed with other lengths and
page tables in tests/gpu/test_cudagraph_cuda.py (kind "spec_decode").

    pytest tests/gpu/test_spec_decode_cuda.py
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.config import CUDAGraphMode  # noqa: E402
from pagedkv.engine.events import StepEvent  # noqa: E402
from tests.gpu.test_cudagraph_cuda import needs_fa4  # noqa: E402

K = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A draft model proposes k tokens for every decoding request, so most decode steps are uniform; a
# random draft of the target's vocabulary (tiny-hybrid for tiny) has drafts rejected at every position.
DRAFT = {"method": "draft_model", "model": "tiny-hybrid", "num_speculative_tokens": K}
# Prompts that repeat a phrase: the n-gram proposer finds drafts from the first decode on.
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(11)] * 4} for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def run(model: str, **kwargs: object) -> tuple[list[list[int]], list[tuple[CUDAGraphMode, bool, int, list[int]]], LLM]:
    """Greedy outputs, and per step (mode, uniform decode key, padded tokens, query lengths)."""
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=8, **kwargs)
    steps: list[tuple[CUDAGraphMode, bool, int, list[int]]] = []

    def listen(event: StepEvent) -> None:
        d = event.result.batch_descriptor
        lens = [s.num_new_tokens for s in event.scheduler_output.scheduled]
        steps.append((event.result.cudagraph_mode, d.uniform_decode, d.num_tokens, lens))

    llm.add_step_listener(listen)
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return outputs, steps, llm


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("TRITON_ATTN", "float32"), pytest.param("FLASH_ATTN", "bfloat16", marks=needs_fa4)],
)
def test_uniform_spec_decode_steps_replay_full_graphs(backend: str, dtype: str) -> None:
    common = dict(attention_backend=backend, dtype=dtype, speculative_config=DRAFT, compile=False)
    graphed, steps, llm = run("tiny", cudagraph_mode="FULL_DECODE_ONLY", **common)
    assert llm.runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY
    uniform = [s for s in steps if set(s[3]) == {1 + K}]
    assert len(uniform) >= 5, f"too few uniform 1 + {K} decode steps to check: {steps}"
    for mode, is_uniform_key, padded, lens in uniform:
        assert mode is CUDAGraphMode.FULL and is_uniform_key, f"a uniform decode step of {lens} ran {mode.name}"
        assert padded % (1 + K) == 0 and padded >= sum(lens)
    assert llm.stats.num_steps_by_graph_mode == dict(Counter(mode.name for mode, *_ in steps))
    eager, _, _ = run("tiny", enforce_eager=True, **common)
    assert graphed == eager
    if dtype == "float32":
        plain, _, _ = run("tiny", attention_backend=backend, dtype=dtype, enforce_eager=True)
        assert graphed == plain
    assert 0 < llm.stats.num_accepted_tokens < llm.stats.num_draft_tokens


def test_triton_mla_full_decode_graphs_are_lowered_for_spec_decode(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        outputs, steps, llm = run(
            "tiny-mla", dtype="float32", speculative_config=NGRAM, cudagraph_mode="FULL_DECODE_ONLY", compile=False
        )
    resolution = llm.runner.cudagraph_resolution
    assert resolution is not None and [step.rule for step in resolution.steps] == [4]
    assert "TRITON_MLA" in resolution.steps[0].cause
    assert llm.runner.cudagraph_mode is CUDAGraphMode.NONE  # not compiled: no piecewise graphs either
    assert any("need support UNIFORM_BATCH" in r.getMessage() for r in caplog.records)
    assert all(mode is CUDAGraphMode.NONE for mode, *_ in steps)
    plain, _, _ = run("tiny-mla", dtype="float32", enforce_eager=True)
    assert outputs == plain
