"""The MLA decode kernel against float64 attention over the gathered latent cache rows.

Each case pages a random latent cache through a permuted block table (never the identity, so a
kernel that ignored the table would fail), poisons `out` with NaN (every row must be written),
and compares with a reference that gathers each request's rows token by token. Shapes are tiny:
without a GPU the kernel runs in Triton's interpreter, one program at a time.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.kernels import MLADecodeWorkspace, SplitKVWorkspace, mla_decode_attention  # noqa: E402
from pagedkv.kernels.mla_decode import default_num_kv_splits  # noqa: E402
from tests.conftest import needs_triton_on_cpu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu":
    pytestmark = needs_triton_on_cpu("CPU kernel tests")
SCALE = 0.125


def make_batch(
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, kv_cache, block_table, seq_lens) with blocks handed out in a random order."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    max_pages = max(max(pages), 1)
    num_blocks = sum(pages) + 3  # a few blocks no request owns
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        block_table[r, :n] = order[used : used + n].int()
        used += n
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, width, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(DEVICE), kv_cache.to(DEVICE), block_table.to(DEVICE), seq.to(DEVICE)


def reference(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int
) -> torch.Tensor:
    """Float64 MQA over each request's rows: scores on all values, output from the latent part."""
    q, kv_cache, block_table = q.cpu().double(), kv_cache.cpu().double(), block_table.cpu()
    block_size = kv_cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float64)
    for r, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        rows = kv_cache[block_table[r, pos // block_size].long(), pos % block_size]  # [n, width]
        probs = (q[r] @ rows.T * SCALE).softmax(-1)  # [heads, n]
        out[r] = probs @ rows[:, :kv_lora_rank]
    return out


def run(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    splits: int | None,
    workspace: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1], kv_lora_rank), float("nan"), dtype=out_dtype or q.dtype, device=DEVICE)
    ws = MLADecodeWorkspace(q.shape[0], q.shape[1], kv_lora_rank, DEVICE, max_splits=8) if workspace else None
    result = mla_decode_attention(
        q, kv_cache, block_table, seq_lens, SCALE, kv_lora_rank, out, workspace=ws, num_kv_splits=splits
    )
    assert result is out
    assert not out.isnan().any(), "unwritten (NaN) output rows"
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


# Requests of length 1, several pages, 0 (a padded slot) and one spanning many pages.
SEQ_LENS = [1, 17, 0, 40, 6]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference(block_size: int, splits: int) -> None:
    batch = make_batch(SEQ_LENS, block_size=block_size, seed=block_size)
    check(run(*batch, 32, splits), reference(*batch, 32), torch.float32)


def test_more_splits_than_pages() -> None:
    """8 splits of requests with 1-2 pages: most splits are empty and must weigh nothing."""
    batch = make_batch([3, 20, 0], block_size=16, seed=1)
    check(run(*batch, 32, 8), reference(*batch, 32), torch.float32)


def test_heads_not_a_multiple_of_the_head_block() -> None:
    """20 heads: a full block of 16 and a block with 4 live rows; automatic split count."""
    batch = make_batch([9, 33], num_heads=20, block_size=4, seed=2)
    check(run(*batch, 32, None), reference(*batch, 32), torch.float32)


def test_without_workspace() -> None:
    batch = make_batch(SEQ_LENS, block_size=4, seed=3)
    check(run(*batch, 32, None, workspace=False), reference(*batch, 32), torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_bfloat16(splits: int) -> None:
    batch = make_batch(SEQ_LENS, block_size=4, dtype=torch.bfloat16, seed=4)
    out = run(*batch, 32, splits)
    assert out.dtype == torch.bfloat16
    check(out, reference(*batch, 32), torch.bfloat16)


@pytest.mark.parametrize("splits", [1, 3])
def test_early_launch_reads_the_query_written_just_before(splits: int) -> None:
    """early_launch=True (on Hopper: the kernel starts while the kernel before it still runs, and
    waits for it before reading the query and the cache). Here that kernel writes the query, a new
    one every call, so a query read too early would give the last call's output."""
    q, kv_cache, block_table, seq_lens = make_batch(SEQ_LENS, block_size=4, dtype=torch.bfloat16, seed=6)
    workspace = MLADecodeWorkspace(q.shape[0], q.shape[1], 32, DEVICE, max_splits=8)
    live, out = torch.empty_like(q), torch.empty(q.shape[0], q.shape[1], 32, dtype=q.dtype, device=DEVICE)
    for step in range(3):
        torch.mul(q, 1.0 - 0.5 * step, out=live)
        mla_decode_attention(
            live,
            kv_cache,
            block_table,
            seq_lens,
            SCALE,
            32,
            out,
            workspace=workspace,
            num_kv_splits=splits,
            early_launch=True,
        )
        check(out, reference(live, kv_cache, block_table, seq_lens, 32), torch.bfloat16)


def test_float32_output_from_bfloat16_inputs() -> None:
    batch = make_batch([5, 12], block_size=4, dtype=torch.bfloat16, seed=5)
    check(run(*batch, 32, 2, out_dtype=torch.float32), reference(*batch, 32), torch.bfloat16)


def test_rank_and_rope_not_powers_of_two() -> None:
    """24 + 8: both parts run padded (to 32 and 16) and masked."""
    batch = make_batch([7, 26, 0], kv_lora_rank=24, rope_dim=8, block_size=4, seed=6)
    check(run(*batch, 24, 3), reference(*batch, 24), torch.float32)


@pytest.mark.parametrize(("kv_lora_rank", "rope_dim"), [(512, 64), (100, 24)])
def test_every_quarter_of_the_latent(kv_lora_rank: int, rope_dim: int) -> None:
    """The kernel handles the latent in four column quarters (LORA_PAD // 4 each). DeepSeek-V2's
    row (512 + 64) fills all four; 100 + 24 fills three and pads the fourth (128 and 32 wide)."""
    batch = make_batch([5, 23], num_heads=16, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, block_size=16, seed=8)
    check(run(*batch, kv_lora_rank, 2), reference(*batch, kv_lora_rank), torch.float32)


def test_rope_part_matters() -> None:
    """The test can fail: zeroing the k_pe part of the cache changes the kernel's output."""
    q, kv_cache, block_table, seq_lens = make_batch([11, 30], block_size=4, seed=7)
    out = run(q, kv_cache, block_table, seq_lens, 32, 1)
    no_rope = kv_cache.clone()
    no_rope[..., 32:] = 0
    changed = run(q, no_rope, block_table, seq_lens, 32, 1)
    check(changed, reference(q, no_rope, block_table, seq_lens, 32), torch.float32)
    assert not torch.allclose(out, changed, atol=1e-2)


def test_default_split_count() -> None:
    """Long sequences of a small batch are split (bounded by pages); a batch that fills the GPU is not."""
    cpu = torch.device("cpu")
    one = default_num_kv_splits(1, 16, 4096, 16, torch.bfloat16, cpu)
    assert 1 < one <= 4096 // 16
    assert default_num_kv_splits(1, 16, 16, 16, torch.bfloat16, cpu) == 1  # one page: nothing to split
    assert default_num_kv_splits(256, 16, 4096, 16, torch.bfloat16, cpu) == 1


def test_bad_input_is_named() -> None:
    q, kv_cache, block_table, seq_lens = make_batch([5], block_size=4)
    out = torch.empty(1, 4, 32, device=DEVICE)

    def call(**overrides: object) -> None:
        args = (
            dict(
                q=q,
                kv_cache=kv_cache,
                block_table=block_table,
                seq_lens=seq_lens,
                scale=SCALE,
                kv_lora_rank=32,
                out=out,
            )
            | overrides
        )
        mla_decode_attention(**args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="rows have 48 values but cache rows 40: both must be"):
        call(kv_cache=kv_cache[..., :40])
    with pytest.raises(ValueError, match="leaves a rope part of 0"):
        call(kv_lora_rank=48, out=torch.empty(1, 4, 48, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be .* \[1, 4, 32\]"):
        call(out=torch.empty(1, 4, 48, device=DEVICE))
    with pytest.raises(ValueError, match="must equal the query dtype"):
        call(kv_cache=kv_cache.bfloat16())
    with pytest.raises(ValueError, match="block_table and seq_lens must be int32"):
        call(seq_lens=seq_lens.long())
    with pytest.raises(ValueError, match="not a power of two"):
        call(kv_cache=kv_cache[:, :3])
    with pytest.raises(TypeError, match="kv_lora_rank must be an int .* got 32.0"):
        call(kv_lora_rank=32.0)
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor, got list"):
        call(block_table=block_table.tolist())
    with pytest.raises(ValueError, match="seq_lens is on meta, q on"):
        call(seq_lens=seq_lens.to("meta"))
    if DEVICE == "cpu":  # checked where it is free: these read past the cache (a segfault on the CPU)
        far = block_table.clone()
        far[0, 0] = kv_cache.shape[0]
        with pytest.raises(ValueError, match=rf"block_table\[0, 0\] = {kv_cache.shape[0]} is not a block"):
            call(block_table=far)
        with pytest.raises(ValueError, match=r"seq_lens must be in \[0, 8\]"):
            call(seq_lens=torch.tensor([9], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs scratch"):
        call(num_kv_splits=2)
    with pytest.raises(ValueError, match="must be an MLADecodeWorkspace"):
        call(workspace=SplitKVWorkspace(4, 4, 32, DEVICE))
    with pytest.raises(ValueError, match=r"needs \[rows, 4, 32\]"):
        call(workspace=MLADecodeWorkspace(1, 8, 32, DEVICE))
    with pytest.raises(ValueError, match="exceeds the workspace"):
        call(workspace=MLADecodeWorkspace(1, 4, 32, DEVICE, max_splits=2), num_kv_splits=3)
