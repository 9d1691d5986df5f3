"""The prefill ladder's rungs (pagedkv/kernels/prefill_ladder.py) under Triton's interpreter, each
against causal softmax attention worked out in float64 one query at a time, on lengths that are not
a multiple of the 16-row tiles (a partial last tile, the diagonal cut short); and the benchmark's
CPU path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.kernels.prefill_ladder import RUNGS, causal_flops, choose_tiles, descriptors  # noqa: E402
from tests.conftest import needs_triton_on_cpu  # noqa: E402

pytestmark = needs_triton_on_cpu("the prefill ladder's tests")
REPO = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
"""Max |error| against float64: float32 errors are ~3e-7; bf16 rounds its output (2^-8 relative)
and P for the PV dot."""


def causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """out[t, h] = softmax over keys s <= t of scale * q[t, h] . k[s, h], applied to v[:t + 1, h]."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            weights = torch.softmax(k[: t + 1, h] @ q[t, h] * scale, dim=0)
            out[t, h] = weights @ v[: t + 1, h]
    return out


def random_qkv(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, heads, head_dim, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("rung", list(RUNGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"),
    [(40, 2, 16), (33, 2, 32), (32, 1, 16), (1, 3, 16)],
    ids=["T40-partial-tile", "T33-one-row-past", "T32-whole-tiles", "T1"],
)
def test_every_rung_matches_float64(rung: str, dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> None:
    q, k, v = random_qkv(tokens, heads, head_dim, dtype, seed=tokens)
    out = RUNGS[rung](q, k, v)
    expected = causal_attention_float64(q, k, v, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    error = (out.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"{rung}: max |error| {error:.3g}"


def test_the_interpreter_tiles_leave_a_partial_tile_and_a_diagonal_of_one_tile() -> None:
    """What the lengths above exercise: tiles of 16, so T = 40 has two whole query tiles and one of 8."""
    assert choose_tiles(16).block_m == choose_tiles(16).block_n == 16


@pytest.mark.parametrize("rung", list(RUNGS))
def test_a_given_scale_and_strided_inputs(rung: str) -> None:
    """q, k, v as views of one fused [T, 3, H, D] projection (token stride 3 * H * D), and a scale of
    0.3 instead of 1 / sqrt(D): the descriptor rungs need packed heads, which these views have."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(37, 3, 2, 16, generator=gen)
    q, k, v = qkv.unbind(1)
    out = RUNGS[rung](q, k, v, softmax_scale=0.3)
    assert (out - causal_attention_float64(q, k, v, 0.3)).abs().max().item() <= 1e-5


def test_causal_flops_counts_the_unmasked_half() -> None:
    # T = 2, H = 1, D = 1: QK^T and PV are each 2 * 2 * 2 = 8 flops dense, 4 causal, 8 together.
    assert causal_flops(2, 1, 1) == 8
    assert causal_flops(8192, 32, 128) == 2 * 32 * 8192**2 * 128


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([40, 2, 24], [40, 2, 24]), "head_dim 24 is not supported: the ladder's tiles need 16, 32, 64 or 128"),
        (([40, 2, 16], [41, 2, 16]), "q, k, v must all be [num_tokens, num_heads, head_dim]; got (40, 2, 16), (41"),
        (([0, 2, 16], [0, 2, 16]), "q has no tokens: a prefill needs num_tokens >= 1"),
    ],
)
def test_bad_shapes_get_one_line_naming_the_value(args: tuple[list[int], list[int]], message: str) -> None:
    q_shape, kv_shape = args
    q, k, v = torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape)
    for rung in RUNGS.values():
        with pytest.raises(ValueError) as info:
            rung(q, k, v)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_dtype_scale_and_layout_get_one_line() -> None:
    q, k, v = random_qkv(8, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=r"dtypes torch.float32, torch.float16, torch.float32: use one of"):
        RUNGS["tiled"](q, k.half(), v)
    with pytest.raises(TypeError, match=r"softmax_scale must be a float .* got '0.1'"):
        RUNGS["tiled"](q, k, v, softmax_scale="0.1")
    heads_apart = torch.randn(2, 8, 16).transpose(0, 1)  # [T, H, D] with the heads 8 * 16 values apart
    with pytest.raises(ValueError, match=r"q has strides \(16, 128, 1\): a tensor descriptor needs each token's heads"):
        descriptors(heads_apart, heads_apart, heads_apart)
    assert RUNGS["pipelined"](heads_apart, heads_apart, heads_apart).shape == (8, 2, 16)  # pointers take any strides


def test_benchmark_cpu_check_and_its_refusal_without_a_gpu(tmp_path: Path) -> None:
    """`--cpu-check` runs every rung under the interpreter and writes JSON only where --json says;
    without it and without a GPU the script says so in one line, no traceback."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = str(REPO / "benchmarks" / "prefill_ladder.py")
    refused = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert refused.stderr == "prefill_ladder: error: no CUDA GPU is visible; run it on a GPU, or pass --cpu-check\n"
    out = tmp_path / "ladder.json"
    done = subprocess.run(
        [sys.executable, script, "--cpu-check", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {row["kernel"] for row in result["rows"]} == set(RUNGS) and all(row["ok"] for row in result["rows"])
    assert result["card"].startswith("CPU") and "--cpu-check" in result["command"]
