"""MLA on a CUDA GPU (issue 13): TRITON_MLA in the engine against transformers, eager and with
FULL_DECODE_ONLY CUDA graphs (decodes replayed, mixed steps eager), and deepseek-v2-lite's shapes.

    pytest tests/gpu/test_mla_cuda.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.compilation import CUDAGraphMode  # noqa: E402
from pagedkv.models.fused_moe import FusedMoE  # noqa: E402
from tests.conftest import write_hf_deepseek  # noqa: E402
from tests.reference import LogitsRecorder, reference_logits  # noqa: E402
from tests.test_deepseek_vs_transformers import PROMPTS, V3_GROUPS, hf_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(path: Path, dtype: str = "float32", **engine: object) -> tuple[list[list[int]], dict[str, torch.Tensor], LLM]:
    llm = LLM(str(path), device="cuda", dtype=dtype, num_kv_blocks=64, block_size=16,
              attention_backend="TRITON_MLA", **engine)
    recorder = LogitsRecorder(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    recorder.detach()
    return ([o.outputs[0].token_ids for o in outs],
            {o.request_id: torch.stack(recorder.rows[o.request_id]) for o in outs}, llm)


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_triton_mla_engine_matches_transformers(tmp_path: Path, mode: str) -> None:
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    tokens, logits, llm = run(path, cudagraph_mode=mode, max_num_batched_tokens=32)
    assert llm.runner.cudagraph_mode is CUDAGraphMode[mode]
    hf = hf_model(path, 3)
    for prompt, generated, rows in zip(PROMPTS, tokens, logits.values()):
        torch.testing.assert_close(rows, reference_logits(hf, prompt, generated).double(), atol=1e-4, rtol=0)


def test_full_decode_graphs_replay_the_eager_logits(tmp_path: Path) -> None:
    path = write_hf_deepseek(tmp_path / "v2", version=2)
    eager_tokens, eager, _ = run(path)
    modes: list[CUDAGraphMode] = []
    graph_tokens, graphed, llm = run(path, cudagraph_mode="FULL_DECODE_ONLY")
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
    eager_tokens, eager, eager_llm = run(path, dtype="bfloat16")
    experts = [m for m in eager_llm.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.use_grouped_mm for m in experts)
    graph_tokens, graphed, _ = run(path, dtype="bfloat16", cudagraph_mode="FULL_DECODE_ONLY")
    assert graph_tokens == eager_tokens
    for a, b in zip(graphed.values(), eager.values()):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)  # bf16: graphs and eager differ by rounding only


def test_deepseek_v2_lite_preset_generates() -> None:
    """The real V2-Lite shapes (27 layers, 64 experts, kv_lora_rank 512) in bf16: a short greedy run."""
    llm = LLM("deepseek-v2-lite", device="cuda", max_model_len=1024, max_num_seqs=8, num_kv_blocks=256,
              attention_backend="TRITON_MLA")
    out = llm.generate(["multi-head latent attention"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    spec = llm.runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert spec.head_size == 576 and spec.page_size_bytes == 16 * 576 * 2


def test_prefill_passes_at_the_v2_lite_shape_match_the_loop_and_float64() -> None:
    """TRITON_MLA's batched prefill (passes through the paged attention kernel) at DeepSeek-V2-Lite's
    attention shape in bf16 (16 heads, latent 512 + 64, qk 192, v 128, pages of 16), on prefills
    with and without cached context, against the shared loop over requests and a float64 reference."""
    check_prefill_passes("cuda", context_lens=[0, 700, 33, 1500], query_lens=[300, 8, 100, 64])


def check_prefill_passes(device: str, context_lens: list[int], query_lens: list[int]) -> None:
    """Both bf16 paths within bf16's reach of float64 (relative error of the whole output), and of
    each other. (Callable on the CPU under TRITON_INTERPRET=1 with short lengths.)"""
    from pagedkv.attention.backend import CommonAttentionMetadata
    from pagedkv.attention.mla.common import MLADims
    from pagedkv.attention.mla.torch_ref_mla import TorchRefMLAMetadataBuilder
    from pagedkv.attention.mla.triton_mla import TritonMLAImpl, TritonMLAMetadataBuilder
    from pagedkv.kv_cache.spec import MLAAttentionSpec

    dims, heads, block_size = MLADims(512, 128, 64, 128), 16, 16
    g = torch.Generator().manual_seed(0)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    pages = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(pages), generator=g) + 1  # block 0 stays the null block
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for i, first in enumerate([0, *torch.tensor(pages).cumsum(0).tolist()[:-1]]):
        block_table[i, : pages[i]] = order[first : first + pages[i]]
    latents = torch.randn(sum(pages) + 1, block_size, dims.latent_size, generator=g).bfloat16()
    q = torch.randn(sum(query_lens), heads, dims.qk_head_dim, generator=g).bfloat16()
    weight = (torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=g)
              / dims.kv_lora_rank**0.5).bfloat16()
    scale = dims.qk_head_dim**-0.5

    # float64 from the same bf16 inputs: K and V per head, causal over each whole sequence.
    w = weight.double().view(heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    expected, new_rows, start = [], [], 0
    for i, (n, m) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(n)
        rows = latents[block_table[i, pos // block_size].long(), pos % block_size]
        new_rows.append(rows[n - m :])
        kv = torch.einsum("hdl,sl->shd", w, rows[:, : dims.kv_lora_rank].double())
        k = torch.cat([kv[..., : dims.qk_nope_head_dim],
                       rows[:, None, dims.kv_lora_rank :].double().expand(-1, heads, -1)], -1)
        scores = torch.einsum("qhd,shd->hqs", q[start : start + m].double(), k) * scale
        scores = scores.masked_fill(pos[None, :] > torch.arange(n - m, n)[:, None], float("-inf"))
        expected.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), kv[..., dims.qk_nope_head_dim :]))
        start += m
    reference = torch.cat(expected)
    kv_c, k_pe = torch.cat(new_rows).to(device).split([dims.kv_lora_rank, dims.qk_rope_head_dim], -1)

    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device), seq_lens_cpu=lens,
        num_reqs=len(seq_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table.to(device),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
    )
    spec = MLAAttentionSpec(block_size, 1, dims.latent_size, torch.bfloat16)
    prefill = TorchRefMLAMetadataBuilder(spec, ["layer"], None, torch.device(device)).build(cm).prefill  # type: ignore[arg-type]
    builder = object.__new__(TritonMLAMetadataBuilder)  # build_prefill needs only the spec and the device
    builder.kv_cache_spec, builder.device = spec, torch.device(device)
    passes = builder.build_prefill(cm, prefill)
    impl = TritonMLAImpl(heads, dims.latent_size, scale, 1, None, torch.bfloat16, mla_dims=dims)
    impl.process_weights_after_loading(weight.to(device))
    outs = []
    for metadata in (passes, prefill):  # plain MLAPrefillMetadata: the shared loop over requests
        out = torch.empty(q.shape[0], heads, dims.v_head_dim, dtype=torch.bfloat16, device=device)
        impl.forward_mha(q.to(device), kv_c, k_pe, latents.to(device), metadata, out)
        outs.append(out.double().cpu())
    relative = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert relative(outs[0], reference) < 1e-2 and relative(outs[1], reference) < 1e-2, \
        (relative(outs[0], reference), relative(outs[1], reference))
    assert relative(outs[0], outs[1]) < 1e-2
