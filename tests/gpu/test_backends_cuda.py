"""TRITON_ATTN and FLASH_ATTN inside the engine on a CUDA GPU: same greedy tokens as the reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.attention.backends.flash_attn import FlashAttentionBackend, flash_attn_version  # noqa: E402
from pagedkv.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402

PROMPTS = [
    "The paged KV cache",
    {"prompt_token_ids": list(range(3, 300))},  # several blocks, chunked with a small budget
    "Hi",
    {"prompt_token_ids": [5] * 40},
]


def greedy_tokens(backend: str, dtype: str) -> list[list[int]]:
    llm = LLM(model="tiny", device="cuda", dtype=dtype, attention_backend=backend, max_model_len=512,
              max_num_batched_tokens=128, num_kv_blocks=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return [o.outputs[0].token_ids for o in outputs]


def test_triton_matches_reference_fp32() -> None:
    assert greedy_tokens("TRITON_ATTN", "float32") == greedy_tokens("TORCH_REF", "float32")


@pytest.mark.skipif(flash_attn_version() is None, reason="flash_attn is not installed")
def test_flash_attn_matches_reference_bf16() -> None:
    # flash-attn computes in fp16/bf16 only: compare both engines in bf16.
    assert greedy_tokens("FLASH_ATTN", "bfloat16") == greedy_tokens("TORCH_REF", "bfloat16")


def test_backend_reasons_on_this_gpu() -> None:
    layer = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, block_size=16, device_type="cuda")
    assert TritonAttentionBackend.validate_configuration(**layer) == []
    fp32 = dict(layer, dtype=torch.float32, kv_cache_dtype=torch.float32)
    assert any("dtype" in r for r in FlashAttentionBackend.validate_configuration(**fp32))
