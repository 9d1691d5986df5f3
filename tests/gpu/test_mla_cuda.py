"""MLA on a CUDA GPU (issue 13): TRITON_MLA in the engine against transformers, eager and with
FULL_DECODE_ONLY CUDA graphs (decodes replayed, mixed steps eager), and deepseek-v2-lite's shapes.

    pytest tests/gpu/test_mla_cuda.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.config import CUDAGraphMode  # noqa: E402
from pagedkv.models.fused_moe import FusedMoE  # noqa: E402
from tests.attention.test_mla import check_prefill_passes  # noqa: E402
from tests.conftest import write_hf_deepseek  # noqa: E402
from tests.kernels.test_mla_kernel import check, make_batch, reference  # noqa: E402
from tests.kernels.test_mla_kernel import run as run_kernel  # noqa: E402
from tests.models.test_deepseek_vs_transformers import PROMPTS, V3_GROUPS, hf_model  # noqa: E402
from tests.reference import LogitsRecorder, reference_logits  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(path: Path, dtype: str = "float32", **engine: object) -> tuple[list[list[int]], dict[str, torch.Tensor], LLM]:
    llm = LLM(
        str(path), device="cuda", dtype=dtype, num_kv_blocks=64, block_size=16, attention_backend="TRITON_MLA", **engine
    )
    recorder = LogitsRecorder(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    recorder.detach()
    return (
        [o.outputs[0].token_ids for o in outs],
        {o.request_id: torch.stack(recorder.rows[o.request_id]) for o in outs},
        llm,
    )


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_triton_mla_engine_matches_transformers(tmp_path: Path, mode: str) -> None:
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    tokens, logits, llm = run(path, cudagraph_mode=mode, compile=False, max_num_batched_tokens=32)
    assert llm.runner.cudagraph_mode is CUDAGraphMode[mode]
    hf = hf_model(path, 3)
    for prompt, generated, rows in zip(PROMPTS, tokens, logits.values()):
        torch.testing.assert_close(rows, reference_logits(hf, prompt, generated).double(), atol=1e-4, rtol=0)


def test_full_decode_graphs_replay_the_eager_logits(tmp_path: Path) -> None:
    path = write_hf_deepseek(tmp_path / "v2", version=2)
    eager_tokens, eager, _ = run(path, enforce_eager=True)
    modes: list[CUDAGraphMode] = []
    graph_tokens, graphed, llm = run(path, cudagraph_mode="FULL_DECODE_ONLY", compile=False)
    assert graph_tokens == eager_tokens
    for a, b in zip(graphed.values(), eager.values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    llm.add_step_listener(lambda e: modes.append(e.result.cudagraph_mode))
    llm.generate([{"prompt_token_ids": list(range(3, 23))}, {"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)
    assert CUDAGraphMode.FULL in modes and CUDAGraphMode.NONE in modes  # decodes replayed, prefills eager


def test_grouped_moe_in_bf16_graphs_replay_the_eager_logits(tmp_path: Path) -> None:
    """bf16 on Hopper takes FusedMoE's grouped way (torch._grouped_mm with the group offsets on the
    device): captured decode steps must route each replay's tokens afresh, so graphs match eager."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's device-offset kernel needs Hopper or newer")
    path = write_hf_deepseek(tmp_path / "v2", version=2)
    eager_tokens, eager, eager_llm = run(path, dtype="bfloat16", enforce_eager=True)
    experts = [m for m in eager_llm.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.use_grouped_mm for m in experts)
    graph_tokens, graphed, _ = run(path, dtype="bfloat16", cudagraph_mode="FULL_DECODE_ONLY", compile=False)
    assert graph_tokens == eager_tokens
    for a, b in zip(graphed.values(), eager.values()):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)  # bf16: graphs and eager differ by rounding only


def test_deepseek_v2_lite_preset_generates() -> None:
    """The real V2-Lite shapes (27 layers, 64 experts, kv_lora_rank 512) in bf16: a short greedy run."""
    llm = LLM(
        "deepseek-v2-lite",
        device="cuda",
        max_model_len=1024,
        max_num_seqs=8,
        num_kv_blocks=256,
        attention_backend="TRITON_MLA",
    )
    out = llm.generate(["multi-head latent attention"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    spec = llm.runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert spec.head_size == 576 and spec.page_size_bytes == 16 * 576 * 2


def test_prefill_passes_at_the_v2_lite_shape_match_the_loop_and_float64() -> None:
    """TRITON_MLA's batched prefill (passes through the paged attention kernel) at DeepSeek-V2-Lite's
    attention shape in bf16 (16 heads, latent 512 + 64, qk 192, v 128, pages of 16), on prefills
    with and without cached context, against the shared loop over requests and a float64 reference."""
    check_prefill_passes("cuda", context_lens=[0, 700, 33, 1500], query_lens=[300, 8, 100, 64])


# Shapes only the compiled kernel meets (the CPU tests keep to tiny ones): a latent of 1024 (the
# widest tiles: 32 rows x 1088 values per pipeline buffer), one padded to 1024 (520), 128 heads
# (eight head blocks), the smallest parts (8 + 2, padded to 64 + 16), a rope part of 128, pages
# of 1 and 128, and each input dtype.
ODD_SHAPES = {  # name -> (heads, kv_lora_rank, rope_dim, block_size, dtype, seq_lens)
    "latent-1024": (16, 1024, 64, 16, torch.bfloat16, [700, 1, 0, 300]),
    "latent-520-17-heads": (17, 520, 64, 64, torch.bfloat16, [257, 64, 1000]),
    "128-heads-fp16": (128, 512, 64, 64, torch.float16, [129, 2000, 5]),
    "smallest-parts-fp32": (3, 8, 2, 1, torch.float32, [1, 90, 33]),
    "rope-128-pages-128": (20, 160, 128, 128, torch.float32, [300, 1, 129]),
}


@pytest.mark.parametrize("name", list(ODD_SHAPES))
def test_decode_kernel_compiled_on_odd_shapes(name: str) -> None:
    """The compiled MLA decode kernel against float64 on shapes past the CPU tests' tiny ones
    (found fine by a random fuzz of 60 shapes on an H200; these are its extremes)."""
    heads, rank, rope, block_size, dtype, seq_lens = ODD_SHAPES[name]
    batch = make_batch(
        seq_lens, num_heads=heads, kv_lora_rank=rank, rope_dim=rope, block_size=block_size, dtype=dtype, seed=len(name)
    )
    check(run_kernel(*batch, rank, None), reference(*batch, rank), dtype)
