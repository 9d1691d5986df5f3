"""The batch-invariant mode on CUDA (bf16, TRITON_ATTN, its Triton matmul and RMSNorm; eager, FULL
decode graphs, and compiled with piecewise and full graphs): a request's logits bitwise the same alone, in a batch of 64, chunked, after a prefix-cache
hit and after preemption. (Without the mode these small models happened to give identical bf16
logits in a batch of 64 on the H200 as well, so the mode-off contrast is the CPU test's, in float32,
and benchmarks/prefix_caching.py's on llama3-8b shapes.)"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedkv.config import CUDAGraphMode  # noqa: E402
from tests.engine.test_batch_invariant import (  # noqa: E402
    TARGET,
    assert_same_model,
    differing_steps,
    engine,
    others,
    target_logits,
)

MODES = [
    pytest.param({"enforce_eager": True}, id="eager"),
    pytest.param({}, id="graphs"),
    # Opt-in: Inductor's pieces around the opaque invariant ops, in piecewise and full graphs.
    pytest.param({"compile": True, "cudagraph_mode": "FULL_AND_PIECEWISE"}, id="compiled"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", ["tiny", "qwen3-0.6b"])
def test_logits_are_bitwise_the_same_in_any_batch_on_cuda(model: str, mode: dict[str, object]) -> None:
    kwargs = dict(model=model, max_model_len=512, **mode)
    llm = engine("TRITON_ATTN", "bfloat16", True, enable_prefix_caching=False, max_num_seqs=64, **kwargs)
    if not mode:
        assert llm.runner.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY  # compile off: FULL decode graphs
    alone = target_logits(llm, [])
    # Equal bits alone are not enough (attention that outputs zeros is invariant too): the same model.
    assert_same_model(
        alone, target_logits(engine("TRITON_ATTN", "bfloat16", False, enable_prefix_caching=False, **kwargs), [])
    )
    for n in (1, 15, 63):
        assert differing_steps(alone, target_logits(llm, others(n, seed=n))) == 0, f"in a batch of {n + 1}"
    chunked = engine("TRITON_ATTN", "bfloat16", True, enable_prefix_caching=True, max_num_batched_tokens=24, **kwargs)
    assert differing_steps(alone, target_logits(chunked, others(7))) == 0, "chunked at 24 tokens"
    assert differing_steps(alone, target_logits(chunked, others(3, seed=5), warm=[TARGET[:33] + [5]])) == 0
    assert chunked.stats.num_cached_tokens >= 32
    tight = engine("TRITON_ATTN", "bfloat16", True, enable_prefix_caching=False, num_kv_blocks=10, **kwargs)
    assert differing_steps(alone, target_logits(tight, [[7 + i] * 16 for i in range(4)], batch_tokens=20)) == 0
    assert tight.resumed > 0  # type: ignore[attr-defined]
