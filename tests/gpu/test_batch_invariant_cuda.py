"""The batch-invariant mode on CUDA.

First the gate of the tiles that follow the batch (pagedkv/batch_invariant.py): every matmul tile of
`MATMUL_TILE_CHOICES` and every attention tile of `INVARIANT_ATTENTION_TILE_CHOICES` must give a row
bitwise the same output; the tables may hold only tiles that pass here (remove one that fails).
Then the whole mode (bf16, TRITON_ATTN, its Triton matmul and RMSNorm; eager, FULL decode graphs,
and compiled with piecewise and full graphs): a request's logits bitwise the same alone, in a batch
of 64, chunked, after a prefix-cache hit and after preemption; its decode steps (M = 1), its prompt
alone (M = 40) and the batch's prefill steps (M up to 2,048) run in all three matmul buckets. (Without
the mode these small models happened to give identical bf16 logits in a batch of 64 on the H200 as
well, so the mode-off contrast is the CPU test's, in float32, and benchmarks/prefix_caching.py's on
llama3-8b shapes.)"""

from __future__ import annotations

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedkv.config import CUDAGraphMode  # noqa: E402
from pagedkv.kernels import unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import INVARIANT_ATTENTION_TILE_CHOICES, KernelConfig  # noqa: E402
from pagedkv.kernels.batch_invariant_triton import (  # noqa: E402
    MATMUL_TILE_CHOICES,
    MATMUL_TILES_BY_M,
    matmul_triton,
)
from pagedkv.kernels.testing import PagedBatch, random_paged_batch  # noqa: E402
from tests.engine.test_batch_invariant import (  # noqa: E402
    TARGET,
    assert_same_model,
    differing_steps,
    engine,
    others,
    target_logits,
)
from tests.gpu.test_kernels_cuda import assert_matches, reference  # noqa: E402

MATMUL_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4100)]
"""llama3-8b's qkv, o, gate_up and down weights as (N, K), and a K that BLOCK_K = 64 does not divide."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), MATMUL_SHAPES)
def test_every_matmul_tile_gives_a_row_the_same_bits(n: int, k: int, dtype: torch.dtype) -> None:
    """Each tile the mode can pick by M gives all 300 rows bitwise what the largest-M tile gives
    each row alone (M = 1), and so does the lookup by M at every bucket's edges."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(300, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    largest_m = MATMUL_TILES_BY_M[-1][1]
    alone = torch.cat([matmul_triton(row[None], w, tiles=largest_m) for row in x])
    exact = x.double() @ w.double().T  # the same matmul, not merely the same bits
    assert ((alone.double() - exact).norm() / exact.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for tiles in MATMUL_TILE_CHOICES:
        differ = (matmul_triton(x, w, tiles=tiles) != alone).any(-1).sum().item()
        assert differ == 0, f"tiles {tiles}: {differ} of 300 rows differ from the rows computed alone"
    for m in (1, 2, 32, 33, 256, 257, 300):
        assert torch.equal(matmul_triton(x[:m], w), alone[:m]), f"M = {m}"


def sharing(base: PagedBatch, starts: list[int], ends: list[int]) -> PagedBatch:
    """Requests over `base`'s one prompt and its cache: request i holds the prompt's queries
    starts[i]..ends[i] - 1 after starts[i] cached tokens (a chunk of the prompt; one token: a decode)."""
    lens = [e - s for s, e in zip(starts, ends, strict=True)]
    return PagedBatch(
        q=torch.cat([base.q[s:e] for s, e in zip(starts, ends, strict=True)]),
        kv_cache=base.kv_cache,
        query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(ends, dtype=torch.int32, device="cuda"),
        block_table=base.block_table[[0] * len(starts)],
        query_lens=lens,
    )


def test_every_attention_tile_gives_a_row_the_same_bits() -> None:
    """One prompt of 300 tokens (Llama-3-8B's heads, bf16): every query row comes out bitwise the
    same with every tile the mode can pick, in the whole prefill, in its second chunk after 170
    cached tokens, as a decode of one token (positions at query-tile and key-tile edges), and as
    such decodes beside that chunk in one mixed batch."""
    base = random_paged_batch(
        [300], [0], num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda", seed=3
    )
    decodes = [0, 3, 15, 16, 63, 64, 127, 128, 200, 255, 256, 299]
    batches = {  # name -> (batch, the prompt position of each of its query tokens)
        "prefill": (base, list(range(300))),
        "chunk": (sharing(base, [170], [300]), list(range(170, 300))),
        "decodes": (sharing(base, decodes, [p + 1 for p in decodes]), decodes),
        "mixed": (sharing(base, [*decodes, 170], [*(p + 1 for p in decodes), 300]), [*decodes, *range(170, 300)]),
    }
    first = None  # the first tile's prefill: row p is position p's
    for tiles in INVARIANT_ATTENTION_TILE_CHOICES:
        config = KernelConfig(tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages)
        for name, (batch, positions) in batches.items():
            out = torch.full_like(batch.q, float("nan"))
            unified_attention(batch.q, batch.k_cache, batch.v_cache, out, **batch.attention_kwargs(), config=config)
            if first is None:
                assert_matches(out, reference(batch), torch.bfloat16)  # the same attention, not merely the same bits
                first = out
            differ = (out != first[positions]).flatten(1).any(-1).nonzero().flatten().tolist()
            assert not differ, f"tiles {tiles}, {name}: positions {[positions[i] for i in differ]} differ"


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
