"""Arguments that used to be accepted and then broke every request (or a request midway) are refused
when the engine starts, by a ValueError naming the argument, the bad value and what would work."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.models.loader import TRAINED_PRESETS
from tests.conftest import edit_config_json

LAYER = "model.layers.1.self_attn.attn"


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 0.0, -0.5])
@pytest.mark.parametrize("which", [0, 1])
def test_kv_cache_scales_must_be_finite_and_positive(scale: float, which: int) -> None:
    """Before, an infinite scale was accepted: every K was stored as 0 and read back as 0 * inf = NaN,
    so every request ended with NaN logits (finish_reason "error")."""
    pair = (scale, 0.5) if which == 0 else (0.5, scale)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"kv_cache_scales[{LAYER!r}] = {pair!r}: give a layer name and two positive floats (k_scale, v_scale), finite"
        ),
    ):
        LLM("tiny", device="cpu", kv_cache_dtype="fp8", kv_cache_scales={LAYER: pair}, num_kv_blocks=16)


def test_finite_kv_cache_scales_still_serve() -> None:
    """The check refuses only what cannot work: a finite scale serves, token for token as the default 1.0
    where it changes nothing (a scale of a power of two only moves the fp8 exponent)."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = [
        LLM("tiny", device="cpu", kv_cache_dtype="fp8", kv_cache_scales=scales, num_kv_blocks=16)
        .generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], greedy)[0]
        .outputs[0]
        for scales in (None, {LAYER: (1.0, 1.0)})
    ]
    assert outs[0].finish_reason == outs[1].finish_reason == "length"
    assert outs[0].token_ids == outs[1].token_ids


@pytest.fixture
def short_draft(tmp_path: Path) -> Path:
    """tiny-pydoc (its vocabulary, so it may draft for tiny-pydoc) with a context of 64 positions."""
    draft = Path(shutil.copytree(TRAINED_PRESETS["tiny-pydoc"], tmp_path / "short-draft"))
    edit_config_json(draft, max_position_embeddings=64)
    return draft


def test_a_draft_model_shorter_than_max_model_len_is_refused(short_draft: Path) -> None:
    """Before, it was accepted and a request that grew past 64 positions died in the draft's RoPE table
    (an IndexError; the CLI exited 1 with it)."""
    spec = {"method": "draft_model", "model": str(short_draft), "num_speculative_tokens": 2}
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"The draft model {str(short_draft)!r} (speculative_config['model']) has max_position_embeddings 64, "
            "below the target 'tiny-pydoc''s max_model_len 1024"
        )
        + r".*Pass max_model_len <= 64",
    ):
        LLM("tiny-pydoc", device="cpu", speculative_config=spec, num_kv_blocks=64)
    # What the message says works does: requests within the draft's context are served.
    llm = LLM("tiny-pydoc", device="cpu", speculative_config=spec, num_kv_blocks=64, max_model_len=64)
    out = llm.generate(["The with statement"], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 40


def test_a_draft_model_refused_for_tensor_parallel_is_named() -> None:
    """Before: "tensor_parallel_size=2: DeepseekV2ForCausalLM models run on one rank only", with no word
    that the model at fault is the draft (the target, tiny, runs on two ranks)."""
    spec = {"method": "draft_model", "model": "tiny-mla", "num_speculative_tokens": 2}
    with pytest.raises(
        NotImplementedError,
        match=r"^"
        + re.escape("The draft model 'tiny-mla' (speculative_config['model']): tensor_parallel_size=2: Deepseek"),
    ):
        LLM("tiny", device="cpu", speculative_config=spec, tensor_parallel_size=2, num_kv_blocks=16)
