"""The CUDA kernels of the batch-invariant mode, run in Triton's interpreter on tiny tiles: right
against float64, and a row's bits independent of how many rows share the call."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's interpreter on CPU tensors (tests/gpu runs the compiled kernels)",
)

TILES = (16, 16, 16, 4, 1)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: small, so M crosses several tiles


@pytest.mark.parametrize("k", [40, 48])  # K cut short in the last tile, and whole tiles (no K mask)
def test_fixed_tile_matmul_matches_float64_and_keeps_rows_invariant(k: int) -> None:
    from pagedkv.kernels.batch_invariant_triton import matmul_triton

    torch.manual_seed(0)
    # 150 rows: 10 row tiles, more than one group of 8 in the programs' grouped order.
    x, w, b = torch.randn(150, k), torch.randn(40, k), torch.randn(40)
    full = matmul_triton(x, w, b, TILES)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-5)
    for m in (1, 3, 16, 17, 129):
        assert torch.equal(matmul_triton(x[:m], w, b, TILES), full[:m]), f"{m} rows"


def test_matmul_takes_a_weights_own_tiles_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight listed in MATMUL_TILES_BY_SHAPE runs with its tiles (bitwise what passing them
    gives), rows still invariant; another weight keeps MATMUL_TILES."""
    from pagedkv.kernels import batch_invariant_triton as bit

    torch.manual_seed(2)
    x, w, other = torch.randn(40, 96), torch.randn(24, 96), torch.randn(32, 96)
    monkeypatch.setitem(bit.MATMUL_TILES_BY_SHAPE, (24, 96), TILES)
    assert bit.matmul_tiles(24, 96) == TILES and bit.matmul_tiles(32, 96) == bit.MATMUL_TILES
    full = bit.matmul_triton(x, w)
    assert torch.equal(full, bit.matmul_triton(x, w, tiles=TILES))
    assert not torch.equal(full, bit.matmul_triton(x, w, tiles=bit.MATMUL_TILES))  # the tiles tell
    assert torch.equal(bit.matmul_triton(x[:5], w), full[:5])
    torch.testing.assert_close(
        bit.matmul_triton(x, other).double(), x.double() @ other.double().T, rtol=1e-5, atol=1e-5
    )


def test_rms_norm_kernel_matches_float64_per_row() -> None:
    from pagedkv.kernels.batch_invariant_triton import rms_norm_triton

    torch.manual_seed(1)
    x, g = torch.randn(9, 48), torch.randn(48)
    got = rms_norm_triton(x, g, 1e-6)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(rms_norm_triton(x[4:5], g, 1e-6), got[4:5])


def test_invariant_attention_tiles_benchmark_runs(tmp_path) -> None:
    """benchmarks/invariant_attention_tiles.py's whole path on one tiny batch: every candidate
    compared with the mode's 16-row tile, token by token (the H200 run answers the question)."""
    from tests.conftest import smoke_run

    result = smoke_run("invariant_attention_tiles.py", tmp_path / "tiles.json")
    assert len(result["rows"]) == 5 and all(r["tokens"] == 11 for r in result["rows"])
    assert all(r["max_abs_diff"] < 0.05 for r in result["rows"])  # the same attention, if not the same bits
