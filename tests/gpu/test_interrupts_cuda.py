"""Ctrl-C on the GPU: a step interrupted in an eager prefill, in a FULL CUDA-graph decode step or in
the sampler is undone, and the run then gives exactly the tokens of an uninterrupted engine (float32, so that a cold and a cached run agree,
TRITON_ATTN, prefix caching on)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv import LLM, SamplingParams
from tests.engine.test_engine_api import assert_idle
from tests.test_interrupts import PROMPTS, patch_point, tokens

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
]


def engine() -> LLM:
    return LLM(
        "tiny",
        device="cuda",
        attention_backend="TRITON_ATTN",
        block_size=16,
        num_kv_blocks=64,
        dtype="float32",
        cudagraph_mode="FULL_DECODE_ONLY",
        compile=False,
    )


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return tokens(engine().generate(PROMPTS, PARAMS[:1] * 2 + PARAMS[1:]))


# The model call: 1 = the prefill (eager), 3 = a decode step replayed from a FULL graph.
@pytest.mark.parametrize(("point", "at"), [("step", 1), ("step", 3), ("sampler", 2), ("cache write", 1)])
def test_interrupted_on_the_gpu_then_rerun(point: str, at: int, expected: list[list[int]]) -> None:
    llm: Any = engine()
    assert llm.runner.cudagraph_mode.name == "FULL_DECODE_ONLY"
    params = PARAMS[:1] * 2 + PARAMS[1:]
    patch_point(llm, point, at)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params)
    assert_idle(llm)
    for _ in range(2):
        assert tokens(llm.generate(PROMPTS, params)) == expected
