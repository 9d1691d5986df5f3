"""TRITON_ATTN and FLASH_ATTN inside the engine on a CUDA GPU, against a float64 reference.

Every token's logits are compared with the same weights run densely in float64 by
`transformers` on the CPU (tests/reference.py), teacher-forced on the tokens the engine chose.
The engines run with the CUDA defaults (compiled, FULL_AND_PIECEWISE lowered to what each
backend allows), so this checks the default path too.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.attention.backends.flash_attn import FlashAttentionBackend, flash_attn_version  # noqa: E402
from pagedkv.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from pagedkv.engine.request import RequestOutput  # noqa: E402
from tests.reference import FP32_ATOL, LogitsRecorder, check_against_reference, reference_errors  # noqa: E402

PROMPTS = [
    "The paged KV cache",
    {"prompt_token_ids": list(range(3, 300))},  # several blocks, chunked with a small budget
    "Hi",
    {"prompt_token_ids": [5] * 40},
]

BF16_MIN_ATOL = 0.5
"""bf16 rounding alone moves these logits (|logit| up to ~20) by up to ~1; a broken backend by ~20."""


def generate(backend: str, dtype: str, model: str = "tiny") -> tuple[LLM, list[RequestOutput], LogitsRecorder]:
    llm = LLM(
        model=model,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        max_model_len=512,
        max_num_batched_tokens=128,
        num_kv_blocks=256,
    )
    recorder = LogitsRecorder(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return llm, outputs, recorder


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_triton_matches_reference_fp32() -> None:
    llm, outputs, recorder = generate("TRITON_ATTN", "float32")
    check_against_reference(llm, outputs, recorder, atol=FP32_ATOL)
    assert tokens(outputs) == tokens(generate("TORCH_REF", "float32")[1])


@pytest.mark.skipif(flash_attn_version() is None, reason="flash_attn is not installed")
# "tiny-hybrid": every other layer sees only the last 32 tokens, and two prompts run past that, so
# FLASH_ATTN's sliding-window branch (window_size passed to flash-attn) is checked too.
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_flash_attn_matches_reference_bf16(model: str) -> None:
    # flash-attn computes in fp16/bf16 only. In bf16 the greedy tokens of two correct backends may
    # part at a near-tie, so each run is checked against the float64 reference on its own tokens,
    # within twice the error TORCH_REF itself has in bf16 on the same prompts.
    ref_llm, ref_outputs, ref_recorder = generate("TORCH_REF", "bfloat16", model)
    ref_error = max(reference_errors(ref_llm, ref_outputs, ref_recorder).values())
    assert ref_error < 4 * BF16_MIN_ATOL, f"TORCH_REF in bf16 is {ref_error:.3g} off the float64 reference"
    llm, outputs, recorder = generate("FLASH_ATTN", "bfloat16", model)
    check_against_reference(llm, outputs, recorder, atol=max(2 * ref_error, BF16_MIN_ATOL))


def test_backend_reasons_on_this_gpu() -> None:
    layer = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, block_size=16, device_type="cuda")
    assert TritonAttentionBackend.validate_configuration(**layer) == []
    fp32 = dict(layer, dtype=torch.float32, kv_cache_dtype=torch.float32)
    assert any("dtype" in r for r in FlashAttentionBackend.validate_configuration(**fp32))
