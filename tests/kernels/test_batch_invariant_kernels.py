"""The CUDA kernels of the batch-invariant mode, run in Triton's interpreter on tiny tiles: right
against float64, and a row's bits independent of how many rows share the call."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.kernels import attention_config
from pagedkv.kernels.attention_config import (
    INVARIANT_ATTENTION_TILE_CHOICES,
    INVARIANT_ATTENTION_TILES,
    KernelConfig,
)

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


def test_matmul_tiles_follow_m_by_bucket() -> None:
    """Hand-worked from the table: M <= 32 takes the narrow tiles, 33-256 the middle ones, larger M
    the widest; an M past every bound is the last bucket's."""
    from pagedkv.kernels.batch_invariant_triton import matmul_tiles

    narrow, middle, wide = (64, 32, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)
    got = {m: matmul_tiles(m, 4096, 4096) for m in (1, 32, 33, 256, 257, 4096)}
    assert got == {1: narrow, 32: narrow, 33: middle, 256: middle, 257: wide, 4096: wide}


def test_every_matmul_tile_sums_k_in_the_same_chunks() -> None:
    """Tiles may follow M only if each output element is summed over the same K chunks in the same
    order: every entry has BLOCK_K = MATMUL_BLOCK_K (the kernel has no split-K: one program per
    output tile), the buckets grow and end with an unbounded one, and MATMUL_TILE_CHOICES (what
    tests/gpu iterates over) is exactly the table's tiles."""
    from pagedkv.kernels.batch_invariant_triton import MATMUL_BLOCK_K, MATMUL_TILE_CHOICES, MATMUL_TILES_BY_M

    assert MATMUL_BLOCK_K == 64
    assert all(tiles[2] == MATMUL_BLOCK_K for _, tiles in MATMUL_TILES_BY_M), MATMUL_TILES_BY_M
    bounds = [bound for bound, _ in MATMUL_TILES_BY_M]
    assert bounds[-1] is None and bounds[:-1] == sorted(set(bounds[:-1]))
    assert set(MATMUL_TILE_CHOICES) == {tiles for _, tiles in MATMUL_TILES_BY_M}
    assert len(MATMUL_TILE_CHOICES) == len(set(MATMUL_TILE_CHOICES)) > 1


@pytest.mark.parametrize("k", [100, 128])  # K cut short in the last 64-wide chunk, and whole chunks
def test_two_table_tiles_match_float64(k: int) -> None:
    """The table's narrowest and widest tiles (and the lookup by M, which picks them for 3 and 300
    rows) compute x @ w.T + b within float32 rounding of float64."""
    from pagedkv.kernels.batch_invariant_triton import MATMUL_TILES_BY_M, matmul_triton

    torch.manual_seed(3)
    x, w, b = torch.randn(300, k), torch.randn(40, k), torch.randn(40)
    exact = x.double() @ w.double().T + b.double()
    for tiles in (MATMUL_TILES_BY_M[0][1], MATMUL_TILES_BY_M[-1][1]):
        torch.testing.assert_close(matmul_triton(x, w, b, tiles).double(), exact, rtol=1e-5, atol=1e-4)
    for m in (3, 300):
        torch.testing.assert_close(matmul_triton(x[:m], w, b).double(), exact[:m], rtol=1e-5, atol=1e-4)


def test_matmul_takes_a_weights_own_tiles_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight listed in MATMUL_TILES_BY_SHAPE runs with its tiles at every M (bitwise what passing
    them gives), rows still invariant; another weight keeps M's bucket."""
    from pagedkv.kernels import batch_invariant_triton as bit

    torch.manual_seed(2)
    x, w, other = torch.randn(40, 96), torch.randn(24, 96), torch.randn(32, 96)
    monkeypatch.setitem(bit.MATMUL_TILES_BY_SHAPE, (24, 96), TILES)
    assert bit.matmul_tiles(1, 24, 96) == bit.matmul_tiles(4096, 24, 96) == TILES
    assert bit.matmul_tiles(4096, 32, 96) == bit.MATMUL_TILES_BY_M[-1][1]
    full = bit.matmul_triton(x, w)
    assert torch.equal(full, bit.matmul_triton(x, w, tiles=TILES))
    assert not torch.equal(full, bit.matmul_triton(x, w, tiles=bit.matmul_tiles(40, 32, 96)))  # the tiles tell
    assert torch.equal(bit.matmul_triton(x[:5], w), full[:5])
    torch.testing.assert_close(
        bit.matmul_triton(x, other).double(), x.double() @ other.double().T, rtol=1e-5, atol=1e-5
    )


def test_cpu_linear_keeps_torch_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors the mode's linear is torch's F.linear in blocks of ROWS rows, as before the
    tiles followed M: the Triton matmul is never called, a row's bits do not depend on M."""
    import torch.nn.functional as F

    from pagedkv import batch_invariant
    from pagedkv.kernels import batch_invariant_triton as bit

    def no_triton(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the CPU path called the Triton matmul")

    monkeypatch.setattr(bit, "matmul_triton", no_triton)
    torch.manual_seed(4)
    x, w = torch.randn(37, 24), torch.randn(8, 24)
    got = batch_invariant.linear(x, w)
    assert torch.equal(got, batch_invariant.row_blocks(lambda block: F.linear(block, w), x))
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(batch_invariant.linear(x[:5], w), got[:5])


def test_by_size_needs_an_unbounded_last_bucket() -> None:
    from pagedkv.kernels.common import by_size

    assert [by_size(((4, "a"), (None, "b")), m) for m in (0, 4, 5)] == ["a", "a", "b"]
    with pytest.raises(ValueError, match="size 5 is past every bucket"):
        by_size(((4, "a"),), 5)


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
    tiles = {tuple(r["tiles"]) for r in result["rows"]}
    assert {(t.block_m, t.block_n, t.num_warps, t.num_stages) for t in INVARIANT_ATTENTION_TILE_CHOICES} < tiles
    assert all(r["tokens"] == 11 for r in result["rows"])
    assert all(r["max_abs_diff"] < 0.05 for r in result["rows"])  # the same attention, if not the same bits


def invariant_config(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> KernelConfig:
    """`batch_invariant_config` as on a GPU (CUDA device, interpreter off: host-side facts only),
    for bf16, a head of 128 and 4 query heads per KV head unless `kwargs` says otherwise."""
    monkeypatch.setattr(attention_config, "interpreting", lambda: False)
    facts = dict(device=torch.device("cuda"), head_pad=128, dtype=torch.bfloat16, num_queries_per_kv=4) | kwargs
    return attention_config.batch_invariant_config(**facts)  # type: ignore[arg-type]


def test_attention_tiles_by_the_longest_requests_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-worked from the table's one bucket: 64 rows, 64 keys, 4 warps, 4 stages and one split for
    a decode and for a 4,096-token prompt; 128 query heads per KV head grow the tile to 128 rows."""
    tiles = {n: invariant_config(monkeypatch, max_query_len=n) for n in (1, 4, 5, 64, 65, 4096)}
    assert {(c.block_m, c.block_n, c.num_warps, c.num_stages, c.num_splits) for c in tiles.values()} == {
        (64, 64, 4, 4, 1)
    }
    assert invariant_config(monkeypatch, num_queries_per_kv=128, max_query_len=1).block_m == 128


def test_attention_keeps_one_tile_where_tests_gpu_does_not_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 (no tensor cores), Triton's interpreter and heads over 128: one tile for every batch."""
    for facts in [dict(dtype=torch.float32), dict(device=torch.device("cpu")), dict(head_pad=256)]:
        assert len({invariant_config(monkeypatch, max_query_len=n, **facts) for n in (1, 5, 4096)}) == 1, facts
    with pytest.raises(ValueError, match="max_query_len=-1"):
        invariant_config(monkeypatch, max_query_len=-1)


def test_every_attention_tile_keeps_the_key_order() -> None:
    """Every tile the mode can pick has the same 64-key tiles (the order of a row's sums) and rows of
    one instruction family (64 or more: wgmma; tests/gpu found 16 and 32 rows giving other bits), and
    the choices tests/gpu iterates over are exactly the table's tiles."""
    assert {t.block_n for _, t in INVARIANT_ATTENTION_TILES} == {64}
    assert min(t.block_m for _, t in INVARIANT_ATTENTION_TILES) >= 64
    assert set(INVARIANT_ATTENTION_TILE_CHOICES) == {t for _, t in INVARIANT_ATTENTION_TILES}
    assert INVARIANT_ATTENTION_TILES[-1][0] is None
