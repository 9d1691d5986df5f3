"""Tensor parallelism over NCCL, one GPU per rank (issue 12, point 6): needs two CUDA GPUs.

tp = 2 with eager steps and with FULL CUDA graphs (the all-reduces captured inside the graph)
against tp = 1 eager and the float64 transformers reference, on a tiny float32 GQA directory.

    pytest tests/gpu/test_tensor_parallel_cuda.py
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs ({torch.cuda.device_count()} visible)"
)

from tests.conftest import write_hf_llama  # noqa: E402
from tests.distributed.test_tensor_parallel import serve  # noqa: E402


@pytest.mark.parametrize("mode", ["NONE", "FULL", "FULL_DECODE_ONLY"])
def test_nccl_tp2_matches_tp1(tmp_path: Path, mode: str) -> None:
    model_dir = str(write_hf_llama(tmp_path / "gqa", num_attention_heads=8, num_key_value_heads=4, hidden_size=64))
    tokens_1, logits_1 = serve(model_dir, 1, device="cuda", enforce_eager=True)
    tokens_2, logits_2 = serve(model_dir, 2, device="cuda", cudagraph_mode=mode, attention_backend="TRITON_ATTN")
    assert tokens_2 == tokens_1
    for a, b in zip(logits_2, logits_1):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert multiprocessing.active_children() == []
