"""The Triton kernels on the CPU, through Triton's interpreter, against float64 dense attention.

Every case builds a random ragged batch over a KV cache whose blocks are handed out in a random
order (a permuted page table), so a kernel that ignored the block table, mixed up requests or
read past a sequence would fail. Shapes are tiny: the interpreter runs programs one at a time.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from pagedkv.kernels import KernelConfig, SplitKVWorkspace, reshape_and_cache, unified_attention
from pagedkv.kernels.attention_config import Tuning, choose_config
from pagedkv.kernels.testing import PagedBatch, random_paged_batch
from pagedkv.kernels.unified_attention import _tma_descriptors
from tests.conftest import needs_triton_on_cpu

pytestmark = needs_triton_on_cpu("CPU kernel tests")
DEVICE = "cpu"


def dense_reference(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    head_size_k: int | None = None,
    head_size_v: int | None = None,
) -> torch.Tensor:
    """Float64 attention per request and head; keys fetched slot by slot through the block table.
    `head_size_k` / `head_size_v`: attend with the first dims of q and K / of V only (default: all)."""
    num_q_heads = batch.q.shape[1]
    _, _, block_size, num_kv_heads, head_size = batch.kv_cache.shape
    group = num_q_heads // num_kv_heads
    flat = batch.kv_cache.double().reshape(2, -1, num_kv_heads, head_size)  # [2, slots, heads, D]
    dk, dv = head_size_k or head_size, head_size_v or head_size
    out = torch.zeros(*batch.q.shape[:2], dv, dtype=torch.float64)
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = batch.query_start_loc[r].item(), batch.query_start_loc[r + 1].item()
        if start == end:
            continue
        pos = torch.arange(seq_len)
        slots = batch.block_table[r, pos // block_size].long() * block_size + pos % block_size
        keys, values = flat[0, slots, :, :dk], flat[1, slots, :, :dv]
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - pos[None, :] < sliding_window
        for h in range(num_q_heads):
            scores = batch.q[start:end, h, :dk].double() @ keys[:, h // group].T * scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:end, h] = probs @ values[:, h // group]
    return out


def run_kernel(batch: PagedBatch, sliding_window: int | None = None, **kwargs: object) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # poisoned: every row must be written
    unified_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        **batch.attention_kwargs(),
        sliding_window=sliding_window,
        **kwargs,
    )
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "unwritten (NaN) output rows"
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (query_lens, context_lens): prefill, decode, chunked prefill and mixed batches.
BATCHES = {
    "prefill": ([7, 33, 1, 18], [0, 0, 0, 0]),
    "decode": ([1, 1, 1, 1, 1], [0, 15, 16, 40, 77]),
    "chunked": ([20, 5], [31, 64]),
    "mixed": ([1, 12, 1, 30, 1], [50, 0, 9, 17, 33]),
}
# (num_q_heads, num_kv_heads): MHA, GQA (a power of two and not), MQA.
HEADS = {"mha": (2, 2), "gqa": (4, 2), "gqa3": (6, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_attention_batches_and_head_layouts(kind: str, heads: str) -> None:
    query_lens, context_lens = BATCHES[kind]
    num_q_heads, num_kv_heads = HEADS[heads]
    batch = random_paged_batch(query_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert_close(run_kernel(batch), dense_reference(batch, 64**-0.5), torch.float32)


@pytest.mark.parametrize("head_size", [64, 96])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_attention_head_and_block_sizes(head_size: int, block_size: int, kind: str) -> None:
    batch = random_paged_batch(*BATCHES[kind], head_size=head_size, block_size=block_size, seed=head_size + block_size)
    assert_close(run_kernel(batch), dense_reference(batch, head_size**-0.5), torch.float32)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("kind", ["mixed", "decode", "chunked"])
def test_attention_sliding_window(window: int, kind: str) -> None:
    batch = random_paged_batch(*BATCHES[kind], seed=window)
    ref = dense_reference(batch, 64**-0.5, sliding_window=window)
    assert_close(run_kernel(batch, sliding_window=window), ref, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("window", [None, 20])
def test_split_kv_decode_matches_unsplit(num_splits: int, window: int | None) -> None:
    # Splits with no keys at all (7 splits of a 15-key sequence) must merge to the same result.
    batch = random_paged_batch([1, 1, 1, 2], [14, 45, 90, 30], seed=num_splits)
    ref = dense_reference(batch, 64**-0.5, sliding_window=window)
    config = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    assert_close(run_kernel(batch, window, config=config), ref, torch.float32)


def test_split_kv_workspace_is_reused_and_bounds_the_splits() -> None:
    batch = random_paged_batch([1, 1, 1], [100, 60, 7])
    workspace = SplitKVWorkspace(rows=6, num_q_heads=4, head_size=64, device=DEVICE)
    ref = dense_reference(batch, 64**-0.5)
    for _ in range(2):  # the same scratch serves consecutive calls
        assert_close(run_kernel(batch, workspace=workspace), ref, torch.float32)
    with pytest.raises(ValueError, match="workspace has 6 rows"):
        workspace.views(num_tokens=3, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_low_precision(dtype: torch.dtype) -> None:
    batch = random_paged_batch(*BATCHES["mixed"], dtype=dtype, seed=3)
    assert_close(run_kernel(batch), dense_reference(batch, 64**-0.5), dtype)


def test_padding_tokens_and_empty_requests_are_left_alone() -> None:
    # CUDA-graph padding: a request with no tokens, and rows past query_start_loc[-1].
    batch = random_paged_batch([3, 0, 1], [5, 0, 20])
    ref = dense_reference(batch, 64**-0.5)
    padded_q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:])])
    out = torch.full_like(padded_q, float("nan"))
    for max_query_len in (3, 16):  # an over-estimate only changes the launch shape
        unified_attention(
            padded_q,
            batch.k_cache,
            batch.v_cache,
            out,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            max_query_len=max_query_len,
            max_seq_len=64,
            block_table=batch.block_table,
            softmax_scale=64**-0.5,
        )
        assert_close(out[:4], ref, torch.float32)
        assert out[4:].isnan().all()


def test_matches_reference_backend() -> None:
    torch_ref = pytest.importorskip("pagedkv.attention.backends.torch_ref")
    batch = random_paged_batch(*BATCHES["mixed"], num_q_heads=4, num_kv_heads=1, head_size=96, seed=11)
    expected = torch.empty_like(batch.q)
    torch_ref.paged_attention_reference(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        expected,
        batch.query_start_loc.tolist(),
        batch.seq_lens.tolist(),
        batch.block_table,
        96**-0.5,
        sliding_window=9,
    )
    torch.testing.assert_close(run_kernel(batch, sliding_window=9), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_size,head_size_v,num_splits", [(96, 64, 1), (64, 32, 1), (48, 80, 1), (96, 64, 3)])
def test_value_head_size_of_its_own(head_size: int, head_size_v: int, num_splits: int) -> None:
    """V narrower or wider than K (MLA's prefill: K 192, V 128): the output has V's head size.
    V is a strided view of the cache's first head_size_v dims, so a kernel that read V with K's
    head size would mix in the dims past it; the output's unused tail must stay untouched."""
    kind = "decode" if num_splits > 1 else "mixed"
    batch = random_paged_batch(*BATCHES[kind], head_size=max(head_size, head_size_v), seed=head_size + head_size_v)
    buffer = torch.full((*batch.q.shape[:2], head_size_v + 8), float("nan"))
    out = buffer[..., :head_size_v]
    config = (
        None
        if num_splits == 1
        else KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    )
    kwargs = dict(batch.attention_kwargs(), softmax_scale=head_size**-0.5)
    unified_attention(
        batch.q[..., :head_size],
        batch.k_cache[..., :head_size],
        batch.v_cache[..., :head_size_v],
        out,
        **kwargs,
        config=config,
    )
    ref = dense_reference(batch, head_size**-0.5, head_size_k=head_size, head_size_v=head_size_v)
    assert_close(out, ref, torch.float32)
    assert buffer[..., head_size_v:].isnan().all(), "the kernel wrote past V's head size"


def test_attention_rejects_unsupported_inputs() -> None:
    batch = random_paged_batch([2], [0], head_size=64)
    kwargs = batch.attention_kwargs() | dict(softmax_scale=1.0)  # max_query_len 2, max_seq_len 2
    q = torch.zeros(2, 4, 300)
    cache = torch.zeros(4, 16, 2, 300)
    with pytest.raises(ValueError, match="head size 300"):
        unified_attention(q, cache, cache, q.clone(), **kwargs)
    q64 = batch.q.double()
    with pytest.raises(ValueError, match="float64"):
        unified_attention(q64, batch.k_cache.double(), batch.v_cache.double(), q64.clone(), **kwargs)
    q3 = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match="3 query heads"):
        unified_attention(q3, batch.k_cache, batch.v_cache, q3.clone(), **kwargs)
    with pytest.raises(ValueError, match=r"out must be .* = \[2, 4, 32\], got \[2, 4, 64\]"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache[..., :32], batch.q.clone(), **kwargs)
    with pytest.raises(ValueError, match="head size 12"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache[..., :12], torch.zeros(2, 4, 12), **kwargs)
    with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_q_heads, head_size\]; got \(2, 256\)"):
        unified_attention(batch.q.flatten(1), batch.k_cache, batch.v_cache, batch.q.clone(), **kwargs)
    with pytest.raises(ValueError, match=r"inconsistent batch: .*block_table \(2,\); expected"):
        unified_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.q.clone(), **kwargs | dict(block_table=batch.block_table[0])
        )
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.q.clone(), **kwargs | dict(seq_lens=[2]))
    with pytest.raises(ValueError, match="k_cache is on meta, q on cpu: put them on one device"):
        unified_attention(batch.q, batch.k_cache.to("meta"), batch.v_cache, batch.q.clone(), **kwargs)
    with pytest.raises(ValueError, match="sliding_window must be None or a positive int"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.q.clone(), **kwargs, sliding_window=4.5)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        unified_attention(batch.q, batch.k_cache, batch.v_cache, batch.q.clone(), **kwargs | dict(softmax_scale="x"))
    workspace = SplitKVWorkspace(rows=8, num_q_heads=4, head_size=64, device=DEVICE)
    with pytest.raises(ValueError, match=r"workspace holds rows of \[4, 64\].*\[4, 32\]"):
        unified_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache[..., :32],
            torch.zeros(2, 4, 32),
            **kwargs,
            workspace=workspace,
            config=KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=2),
        )


def test_attention_on_cpu_tensors_rejects_indices_past_its_tensors() -> None:
    """Where the check costs no device sync (CPU tensors, the interpreter): each of these read
    outside a tensor, which on the CPU was a segfault that ended the Python process."""
    batch = random_paged_batch([3], [5], head_size=16, block_size=4)
    kwargs = batch.attention_kwargs() | dict(softmax_scale=1.0)  # max_query_len 3, max_seq_len 8

    def call(**changes: object) -> None:
        unified_attention(batch.q, batch.k_cache, batch.v_cache, torch.empty_like(batch.q), **kwargs | changes)

    far = batch.block_table.clone()
    far[0, 1] = 1000
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 1000 is not a block of the cache"):
        call(block_table=far)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[0, 12\] \(the block table's 3 pages of 4 tokens\)"):
        call(seq_lens=torch.tensor([40], dtype=torch.int32), max_seq_len=40)
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to at most the 3 tokens"):
        call(query_start_loc=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_query_len=1 and max_seq_len=8 must bound the batch's 3 and 8"):
        call(max_query_len=1)  # left query rows unwritten, without a word


# --- reshape_and_cache -----------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(2, 64, 16), (3, 96, 32), (1, 80, 16)])
def test_reshape_and_cache_scatters_by_slot(
    slot_dtype: torch.dtype, num_kv_heads: int, head_size: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_blocks, num_tokens = 6, 11
    # One (2, blocks, block_size, heads, D) tensor per layer; K and V are strided views of it.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    before = kv_cache.clone()
    # K and V as the model makes them: slices of one fused projection (non-contiguous rows).
    qkv = torch.randn(num_tokens + 2, 3, num_kv_heads, head_size, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots.to(slot_dtype))

    expected = before.reshape(2, -1, num_kv_heads, head_size).clone()
    written = slots >= 0
    expected[0, slots[written]] = key[:num_tokens][written]
    expected[1, slots[written]] = value[:num_tokens][written]
    assert torch.equal(kv_cache.reshape(2, -1, num_kv_heads, head_size), expected)


def test_reshape_and_cache_addresses_v_through_its_own_strides() -> None:
    """K and V caches of the same shape but different layouts: each is written through its own strides."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, head_size = 4, 8, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, heads, head_size)
    v_cache = torch.zeros(num_blocks, heads, block_size, head_size).transpose(1, 2)  # heads before slots
    key, value = torch.randn(2, 5, heads, head_size, generator=gen)
    slots = torch.tensor([3, 9, -1, 20, 31])
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    written = slots >= 0
    assert torch.equal(k_cache.reshape(-1, heads, head_size)[slots[written]], key[written])
    assert torch.equal(v_cache.reshape(-1, heads, head_size)[slots[written]], value[written])


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASH_ATTN"])
def test_impl_cache_write_scatters_by_slot(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each impl's `do_kv_cache_update` writes exactly the slots (FLASH_ATTN reuses TRITON_ATTN's
    scatter; flash-attn itself is faked here, since only its kernel needs a GPU)."""
    from pagedkv.attention.backends import flash_attn
    from pagedkv.attention.selector import load_backend

    monkeypatch.setattr(flash_attn, "flash_attn_version", lambda: 4)
    monkeypatch.setattr(flash_attn, "_varlen_func", lambda version: None)
    impl = load_backend(backend).get_impl_cls()(4, 16, 0.25, 2, None, torch.float32)
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, 5, 8, 2, 16, generator=gen)
    expected = kv_cache.clone().reshape(2, -1, 2, 16)
    key, value = torch.randn(2, 6, 2, 16, generator=gen)
    slots = torch.tensor([3, 17, -1, 30, 9, 38])
    for _ in range(2):  # the second call reuses the cached K/V views
        impl.do_kv_cache_update(None, key, value, kv_cache, slots)
    expected[0, slots[slots >= 0]] = key[slots >= 0]
    expected[1, slots[slots >= 0]] = value[slots >= 0]
    assert torch.equal(kv_cache.reshape(2, -1, 2, 16), expected)


def test_reshape_and_cache_then_attention_low_precision() -> None:
    # A whole step: write this step's K/V, then attend over the cache that now holds them.
    batch = random_paged_batch([4, 1], [0, 21], dtype=torch.bfloat16, seed=5)
    num_kv_heads, head_size = batch.kv_cache.shape[3:]
    new_k = torch.randn(5, num_kv_heads, head_size).to(torch.bfloat16)
    new_v = torch.randn(5, num_kv_heads, head_size).to(torch.bfloat16)
    slots = batch.query_slots()
    reshape_and_cache(new_k, new_v, batch.k_cache, batch.v_cache, slots)
    flat = batch.kv_cache.reshape(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[0, slots], new_k) and torch.equal(flat[1, slots], new_v)
    assert_close(run_kernel(batch), dense_reference(batch, head_size**-0.5), torch.bfloat16)


def test_reshape_and_cache_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="do not match"):
        reshape_and_cache(
            torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), cache[0], cache[1], torch.zeros(3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="int32/int64"):
        reshape_and_cache(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0], cache[1], torch.zeros(3))
    with pytest.raises(ValueError, match="k_cache is on meta, key on cpu: put them on one device"):
        reshape_and_cache(
            torch.zeros(3, 2, 64),
            torch.zeros(3, 2, 64),
            cache[0].to("meta"),
            cache[1],
            torch.zeros(3, dtype=torch.long),
        )
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        reshape_and_cache(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0], cache[1], [0, 1, 2])
    if DEVICE == "cpu":  # checked where it is free (a slot past the cache was a segfault on the CPU)
        with pytest.raises(ValueError, match=r"slots in \[0, 64\) or -1 \(skip\), got values from 0 to 6400000"):
            reshape_and_cache(
                torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache[0], cache[1], torch.tensor([0, 5, 6_400_000])
            )


# --- the backends on top of the kernels ----------------------------------------------------------


ENGINE_PROMPTS = ["Hello there", {"prompt_token_ids": list(range(1, 30))}]


def run_backend_in_the_engine(backend: str = "TRITON_ATTN") -> None:
    """Two prompts through `backend` in float32: logits match the float64 reference, tokens match TORCH_REF's."""
    from pagedkv import LLM, SamplingParams
    from tests.reference import generate_checked

    tokens = {}
    for name in (backend, "TORCH_REF"):
        llm = LLM(
            model="tiny",
            device="cpu",
            dtype="float32",
            attention_backend=name,
            max_model_len=64,
            max_num_seqs=4,
            num_kv_blocks=16,
        )
        outputs = generate_checked(llm, ENGINE_PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[backend] == tokens["TORCH_REF"]


@pytest.mark.slow
def test_triton_backend_in_the_engine_matches_reference() -> None:
    run_backend_in_the_engine("TRITON_ATTN")


def test_triton_backend_refuses_non_causal_metadata() -> None:
    """Its kernel masks causally: metadata that asks for non-causal attention must be an error,
    not a causal answer to another question."""
    import dataclasses

    from pagedkv import LLM, SamplingParams

    llm = LLM(model="tiny", device="cpu", attention_backend="TRITON_ATTN", num_kv_blocks=16)
    events = []
    llm.add_step_listener(events.append)
    llm.generate(ENGINE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))
    name, layer = next(iter(llm.runner.attn_layers.items()))
    metadata = dataclasses.replace(events[0].result.attn_metadata[name], causal=False)
    q = torch.zeros(metadata.num_actual_tokens, layer.num_heads, layer.head_size)
    with pytest.raises(NotImplementedError, match="causal"):
        layer.impl.forward(layer, q, q, q, layer.kv_cache, metadata, torch.empty_like(q))


def test_interpreter_probe_runs_on_the_cpu_under_a_meta_device() -> None:
    """The interpreter probe's first call can come while a model is built on the meta device (an
    `LLM` whose first TRITON_ATTN layer asks the selector): it still runs on the CPU and answers."""
    from pagedkv.kernels.common import _interpreter_loop_problem, interpreter_problem

    _interpreter_loop_problem.cache_clear()
    try:
        with torch.device("meta"):
            assert interpreter_problem() is None
    finally:
        _interpreter_loop_problem.cache_clear()


def test_backend_reasons_on_the_cpu() -> None:
    from pagedkv.attention.backends.flash_attn import FlashAttentionBackend
    from pagedkv.attention.backends.triton_attn import TritonAttentionBackend

    layer = dict(head_size=64, dtype=torch.float32, kv_cache_dtype=torch.float32, block_size=16, device_type="cpu")
    assert TritonAttentionBackend.validate_configuration(**layer) == []  # the interpreter runs it
    assert any("head size 12" in r for r in TritonAttentionBackend.validate_configuration(**dict(layer, head_size=12)))
    reasons = FlashAttentionBackend.validate_configuration(**layer)
    assert any("device 'cpu'" in r for r in reasons) and any("float32" in r for r in reasons)
    if not torch.cuda.is_available():
        assert any("not installed" in r or "compute capability" in r for r in reasons)


def test_a_mixed_batch_gives_its_decodes_a_launch_of_their_own() -> None:
    # 63 decodes beside one 2,048-token prompt (GQA 4): the decodes get 16-row tiles (4 queries x 4
    # heads) and no split; a batch of prompts only, or of decodes only, stays one launch.
    def config(query_lens: list[int], tuning: Tuning | None = None) -> KernelConfig:
        return choose_config(
            device=torch.device("cpu"),
            head_pad=128,
            dtype=torch.bfloat16,
            num_queries_per_kv=4,
            num_kv_heads=8,
            num_reqs=len(query_lens),
            num_tokens=sum(query_lens),
            max_query_len=max(query_lens),
            max_seq_len=4096,
            tuning=tuning or Tuning(),
        )

    mixed = config([1] * 63 + [2048])
    assert mixed.short_rows is not None and mixed.short_rows.block_m == 16 and mixed.short_rows.num_splits == 1
    assert mixed.block_m > 16
    # 8 prompts of 1,024 hold 8,192 tokens: were one of them a decode, they would hold at most 7 x 1,024 + 1.
    assert config([1024] * 8).short_rows is None
    assert config([1] * 64).short_rows is None
    assert config([1] * 63 + [2048], Tuning(split_mixed=False)).short_rows is None


@pytest.mark.parametrize("kind", ["prefill", "chunked", "mixed"])
def test_tma_tiles_match_the_reference_and_ignore_stale_slots(kind: str) -> None:
    # Pages of 32 keys hold two 16-key tiles each, so q, K and V go through tensor descriptors (the
    # interpreter runs them as plain box copies). The slots past each sequence in its last page are
    # NaN, as stale values may be: a masked V tile that is not zeroed turns its row into NaN.
    batch = random_paged_batch(*BATCHES[kind], block_size=32, seed=11)
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        if seq_len % 32:
            batch.kv_cache[:, batch.block_table[r, seq_len // 32], seq_len % 32 :] = float("nan")
    config = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=True)
    assert _tma_descriptors(batch.q, batch.k_cache, batch.v_cache, config) is not None
    assert_close(run_kernel(batch, config=config), dense_reference(batch, 64**-0.5), torch.float32)
