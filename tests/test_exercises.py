"""The workbook's exercise checkers (notebooks 00, 01, 03, 04, 05, 07): each accepts a right answer
written here (not the package's function), rejects a wrong one with a message that says what is
wrong, and rejects the package's own implementation handed back (or called) as the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.attention.layer import get_attention_context
from pagedkv.attention.selector import get_attn_backend, unregister_backend
from pagedkv.exercises import CheckResult
from pagedkv.exercises.attention_groups import (
    check_lengths,
    check_null_blocks,
    manager_window_rows,
    sliding_window_rows,
    step_lengths,
)
from pagedkv.exercises.backends import check_backend
from pagedkv.exercises.environment import check_choose_backend, environment_report, runs_here
from pagedkv.workbook import list_notebooks
from pagedkv.exercises.forward_context import check_attention_context
from pagedkv.exercises.flash_attention import check_kernel_block_rows
from pagedkv.exercises.model_file import MODEL_HEADS, TP_SIZES, build_attention, check_head_layout, check_qkv_width
from pagedkv.models.layers import head_layout
from pagedkv.forward_context import get_forward_context
from pagedkv.worker.attn_utils import to_kernel_block_table


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", device="cpu", num_kv_blocks=32)


def assert_rejected(result: CheckResult, *phrases: str) -> None:
    assert isinstance(result, CheckResult)
    assert not result, result.message
    assert repr(result).startswith("❌")
    for phrase in phrases:
        assert phrase in result.message, result.message


# ---- 00: environment -------------------------------------------------------------------


def test_environment_report_and_workbook_map() -> None:
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["default device"] in ("cpu", "cuda")
    assert [nb.name[:2] for nb in list_notebooks()] == [f"{i:02d}" for i in range(13)]
    assert runs_here("cpu").startswith("yes")
    with pytest.raises(ValueError):
        runs_here("tpu")


def test_choose_backend(tiny: LLM) -> None:
    def right(priority: list[str], reasons: dict[str, list[str]]) -> str | None:
        for name in priority:
            if not reasons[name]:
                return name
        return None

    result = check_choose_backend(tiny, right)
    assert result, result.message
    assert "TORCH_REF serves 'model.layers.0.self_attn.attn'" in result.message
    # Right on this CPU (priority ['TORCH_REF']), wrong on the checker's own cases:
    for wrong, phrase in [
        (lambda p, r: p[0], "refuses the layer"),
        (lambda p, r: next((n for n in r if not r[n]), None), "expected"),
        (lambda p, r: "TORCH_REF", "expected"),
        # never None: the always-tried case where every backend refuses (random cases had it 8% of the time)
        (lambda p, r: next((n for n in p if not r[n]), p[0]), "expected None"),
    ]:
        assert_rejected(check_choose_backend(tiny, wrong), "For priority", phrase)
    assert_rejected(check_choose_backend(tiny, get_attn_backend), "pagedkv's own get_attn_backend")
    assert_rejected(check_choose_backend(tiny, lambda p, r: get_attn_backend(head_size=16, dtype=None,
                                                                        kv_cache_dtype=None, block_size=16)),
                    "calls pagedkv's own get_attn_backend")
    assert_rejected(check_choose_backend(tiny, "TORCH_REF"), "function itself")


def test_choose_backend_explains_each_kind_of_mistake() -> None:
    from pagedkv.exercises.environment import _explain_choice

    reasons = {"A": ["no"], "B": [], "C": [], "D": []}
    assert "A refuses the layer (no)" in _explain_choice("A", "B", ["A", "B", "C"], reasons)
    assert "B comes earlier" in _explain_choice("C", "B", ["A", "B", "C"], reasons)
    assert "only backends in the priority list" in _explain_choice("D", "B", ["A", "B", "C"], reasons)
    assert "return None" in _explain_choice("A", None, ["A"], reasons)


# ---- 01: the model file ------------------------------------------------------------------

def test_qkv_width() -> None:
    def right(hidden_size: int, hq: int, hkv: int, head_dim: int, tp: int) -> int:
        return (hq // tp + 2 * max(hkv // tp, 1)) * head_dim

    result = check_qkv_width(right)
    assert result, result.message
    assert "(7 + 2 x 1) heads x 128" in result.message  # Qwen2-7B at tp_size 4, worked by hand: 1152
    qwen = "fn(3584, 28, 4, 128, 4)"
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d), qwen, "whole model")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: 3 * (hq // tp) * d), qwen, "own K and V")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq // tp) * d), qwen, "only the query part")
    # Right for Qwen2-7B (4 KV heads over 4 ranks), wrong once KV heads are replicated: 40 random cases hold one.
    floor_split = check_qkv_width(lambda h, hq, hkv, d, tp: (hq // tp + 2 * (hkv // tp)) * d, num_hidden=0)
    assert_rejected(floor_split, "fn(4096, 64, 8, 128, 16)", "replicated")  # a fixed case, not left to chance
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: (hq + 2 * hkv) * d // tp, num_hidden=0),
                    "fn(4096, 64, 8, 128, 16)")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: "1152"), qwen, "an int")
    # The notebook's number typed in passes its case only; the module built by the package does not count.
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: 1152), "is not it")
    assert_rejected(check_qkv_width(build_attention), "pagedkv's own build_attention")
    assert_rejected(check_qkv_width(lambda h, hq, hkv, d, tp: build_attention(hq, hkv, tp, d, h).qkv_proj.out_features),
                    "calls pagedkv's own build_attention")
    assert_rejected(check_qkv_width(1152), "function itself")


def test_head_layout() -> None:
    def right(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        return hq // tp, max(hkv // tp, 1), max(tp // hkv, 1)

    assert check_head_layout(right)
    assert_rejected(check_head_layout(lambda hq, hkv, tp: (hq // tp, hkv // tp, 1)),
                    "KV heads per rank 0 (expected 1)", "copied")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: (hq // tp, max(hkv // tp, 1), 1)),
                    "replicas of each KV head 1 (expected 2)")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: None), "tuple of three ints")
    assert_rejected(check_head_layout(42), "function itself")
    assert_rejected(check_head_layout(head_layout), "pagedkv's own head_layout")
    assert_rejected(check_head_layout(lambda hq, hkv, tp: head_layout(hq, hkv, tp)),
                    "calls pagedkv's own head_layout")


def test_head_layout_has_cases_the_notebook_never_printed() -> None:
    # A table of every fixed case (the notebook prints most of them) fails on the random ones.
    printed = {}
    for hq, hkv in MODEL_HEADS:
        for tp in TP_SIZES:
            try:
                printed[(hq, hkv, tp)] = head_layout(hq, hkv, tp)
            except ValueError:
                continue

    def copied(hq: int, hkv: int, tp: int) -> tuple[int, int, int]:
        layout = printed.get((hq, hkv, tp))
        return (layout.num_heads, layout.num_kv_heads, layout.kv_head_replicas) if layout else (0, 0, 0)

    assert_rejected(check_head_layout(copied), "expected")


# ---- 03: the forward context ---------------------------------------------------------------


def test_attention_context(tiny: LLM) -> None:
    def right(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def whole_dict(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata, layer, layer.kv_cache, ctx.slot_mapping.get(name)

    def other_layer(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers["model.layers.3.self_attn.attn"]
        return ctx.attn_metadata[name], layer, layer.kv_cache, ctx.slot_mapping.get(name)

    assert check_attention_context(tiny, right)
    assert_rejected(check_attention_context(tiny, whole_dict), "whole attn_metadata dict")
    assert_rejected(check_attention_context(tiny, other_layer), "layer is wrong", "model.layers.3")

    def first_entries(name: str) -> tuple[Any, ...]:  # right on "tiny" (one group), not on "tiny-hybrid"
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return next(iter(ctx.attn_metadata.values())), layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    assert_rejected(check_attention_context(tiny, first_entries), "metadata of a layer in another group")

    def first_slots(name: str) -> tuple[Any, ...]:
        ctx = get_forward_context()
        layer = ctx.no_compile_layers[name]
        return ctx.attn_metadata[name], layer, layer.kv_cache, next(iter(ctx.slot_mapping.values()))

    assert_rejected(check_attention_context(tiny, first_slots), "slot mapping of a layer in another KV cache group")
    assert_rejected(check_attention_context(tiny, lambda name: name), "tuple of 4")
    assert_rejected(check_attention_context(tiny, lambda name: 1 / 0), "ZeroDivisionError")
    assert_rejected(check_attention_context(tiny, get_attention_context), "pagedkv's own get_attention_context")
    assert_rejected(check_attention_context(tiny, lambda name: get_attention_context(name)),
                    "calls pagedkv's own get_attention_context")
    assert not any(layer._forward_pre_hooks for layer in tiny.runner.attn_layers.values())  # hooks removed


# ---- 04: attention backends -----------------------------------------------------------------


@dataclass
class _Meta:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class _Builder(AttentionMetadataBuilder[_Meta]):
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> _Meta:
        cm = common_attn_metadata
        return _Meta(cm.query_start_loc_cpu.tolist(), cm.seq_lens_cpu.tolist(), cm.block_table_tensor, cm.slot_mapping)


class _Impl(AttentionImpl[_Meta]):
    """A correct naive paged attention; class flags switch on the classic bugs."""

    causal = True
    interleave = True
    in_place = True
    windowed = True
    slot_shift = 0

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: _Meta | None, output: torch.Tensor) -> torch.Tensor:
        if attn_metadata is None:
            return output.zero_()
        m = attn_metadata
        k_cache, v_cache = kv_cache.unbind(0)
        bs = k_cache.shape[1]
        real = m.slot_mapping >= 0
        slots = m.slot_mapping[real] + self.slot_shift
        n = m.slot_mapping.shape[0]
        k_cache[slots // bs, slots % bs] = key[:n][real]
        v_cache[slots // bs, slots % bs] = value[:n][real]
        result = torch.zeros_like(output)
        g = self.num_queries_per_kv
        for i, seq_len in enumerate(m.seq_lens):
            start, end = m.query_start_loc[i], m.query_start_loc[i + 1]
            pos = torch.arange(seq_len)
            blocks = m.block_table[i, pos // bs].long()
            k, v = k_cache[blocks, pos % bs], v_cache[blocks, pos % bs]
            if self.interleave:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            else:
                k, v = k.repeat(1, g, 1), v.repeat(1, g, 1)
            scores = torch.einsum("qhd,khd->hqk", query[start:end], k) * self.scale
            if self.causal:
                q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
                scores = scores.masked_fill(pos[None, :] > q_pos, float("-inf"))
            if self.windowed and self.sliding_window is not None:
                q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
                scores = scores.masked_fill(q_pos - pos[None, :] >= self.sliding_window, float("-inf"))
            result[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        if self.in_place:
            output.copy_(result)
            return output
        return result


def _backend(name: str, **bugs: object) -> type[AttentionBackend]:
    impl = type(f"{name}Impl", (_Impl,), bugs)

    class _Backend(AttentionBackend):
        forward_includes_kv_cache_update = True
        supported_devices = ("cpu", "cuda")

        @staticmethod
        def get_name() -> str:
            return name

        @staticmethod
        def get_impl_cls() -> type[AttentionImpl[Any]]:
            return impl

        @staticmethod
        def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]:
            return _Builder

    return _Backend


@pytest.mark.parametrize(
    ("name", "bugs", "phrases"),
    [
        ("TEST_NO_MASK", {"causal": False}, ["causal mask"]),
        ("TEST_REPEAT", {"interleave": False}, ["heads [1, 2] are wrong", "repeat_interleave"]),
        ("TEST_NEW_TENSOR", {"in_place": False}, ["new tensor", "output"]),
        ("TEST_SHIFTED", {"slot_shift": 1}, ["KV cache write is wrong", "slot_mapping"]),
        ("TEST_NO_WINDOW", {"windowed": False}, ["sliding window of 32", "Mask the older keys"]),
    ],
)
def test_backend_rejects_classic_bugs(name: str, bugs: dict[str, object], phrases: list[str]) -> None:
    try:
        assert_rejected(check_backend(_backend(name, **bugs), device="cpu"), *phrases)
    finally:
        unregister_backend(name)


def test_backend_accepts_a_correct_one() -> None:
    try:
        result = check_backend(_backend("TEST_NAIVE"), device="cpu")
        assert result, result.message
        assert "every attention output matches TORCH_REF" in result.message
    finally:
        unregister_backend("TEST_NAIVE")


def test_backend_rejects_the_reference_handed_back() -> None:
    from pagedkv.attention.backends.torch_ref import TorchRefBackend, TorchRefImpl, paged_attention_reference
    from pagedkv.kernels import reshape_and_cache

    class Renamed(TorchRefBackend):  # the trivial answer: TORCH_REF under another name
        @staticmethod
        def get_name() -> str:
            return "TEST_RENAMED"

    class Delegating(_Impl):  # its own class, but the attention is TORCH_REF's function
        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
            if attn_metadata is None:
                return output.zero_()
            return paged_attention_reference(query, *kv_cache.unbind(0), output, attn_metadata.query_start_loc,
                                             attn_metadata.seq_lens, attn_metadata.block_table, self.scale)

    class Wrapping(TorchRefImpl):  # overrides the work methods, but only to call the inherited ones
        def forward(self, *args: Any) -> torch.Tensor:
            return super().forward(*args)

        def do_kv_cache_update(self, *args: Any) -> None:
            super().do_kv_cache_update(*args)

    class TritonWrite(_Impl):  # its own attention, but the package's Triton kernel writes the cache
        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
            if attn_metadata is not None:
                reshape_and_cache(key, value, *kv_cache.unbind(0), attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)

    triton_write = _backend("TEST_TRITON_WRITE")
    triton_write.get_impl_cls = staticmethod(lambda: TritonWrite)  # type: ignore[method-assign]
    from pagedkv.attention.backends.triton_attn import TritonCacheWriter

    class BorrowedWrite(TritonCacheWriter, _Impl):  # its own forward, TRITON_ATTN's cache write
        pass

    borrowed = _backend("TEST_BORROWED")
    borrowed.get_impl_cls = staticmethod(lambda: BorrowedWrite)  # type: ignore[method-assign]
    delegating = _backend("TEST_DELEGATING")
    delegating.get_impl_cls = staticmethod(lambda: Delegating)  # type: ignore[method-assign]

    class WrappingBackend(TorchRefBackend):
        @staticmethod
        def get_name() -> str:
            return "TEST_WRAPPING"

        @staticmethod
        def get_impl_cls() -> type[AttentionImpl[Any]]:
            return Wrapping

    try:
        assert_rejected(check_backend(Renamed, device="cpu"), "inherits the forward of TorchRefImpl")
        assert_rejected(check_backend(delegating, device="cpu"), "calls pagedkv's own paged_attention_reference")
        assert_rejected(check_backend(triton_write, device="cpu"), "calls pagedkv's own reshape_and_cache")
        assert_rejected(check_backend(borrowed, device="cpu"), "inherits the do_kv_cache_update of TritonCacheWriter")
        assert_rejected(check_backend(WrappingBackend, device="cpu"), "calls pagedkv's own TorchRefImpl.")
    finally:
        for name in ("TEST_RENAMED", "TEST_DELEGATING", "TEST_WRAPPING", "TEST_TRITON_WRITE", "TEST_BORROWED"):
            unregister_backend(name)


def test_backend_rejects_non_backends() -> None:
    assert_rejected(check_backend(42), "AttentionBackend subclass")
    assert_rejected(check_backend(_backend("TEST_X")()), "AttentionBackend subclass")  # an instance
    assert_rejected(check_backend(_backend("TORCH_REF")), "built-in backend's name")


# ---- 05: attention groups and metadata ---------------------------------------------------------


def test_lengths() -> None:
    llm = LLM("tiny-hybrid", device="cpu", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    events: list[Any] = []
    llm.add_step_listener(events.append)
    llm.generate([{"prompt_token_ids": list(range(1, 6))}, {"prompt_token_ids": list(range(1, 12))}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    event = events[1]  # a decode of request 0 and a prefill chunk of request 1
    expected = step_lengths(event)
    assert expected["query_lens"] == [1, 7] and expected["context_lens"] == [5, 3]
    assert check_lengths(event, query_lens=[1, 7], context_lens=(5, 3))
    assert check_lengths(event, query_lens=torch.tensor([1, 7]), context_lens=np.array([5, 3]))  # was a crash
    assert_rejected(check_lengths(event, query_lens=[1, 8], context_lens=[5, 3]), "query_lens", "entry 1 is 8")
    assert_rejected(check_lengths(event, query_lens=[1, 7], context_lens=[6, 10]),
                    "context_lens", "seq_len - query_len")


def test_null_blocks() -> None:
    assert check_null_blocks(lambda c, w, b: max(c - w + 1, 0) // b)
    assert_rejected(check_null_blocks(lambda c, w, b: (c - w) // b), "your function says -8", "max(")
    assert_rejected(check_null_blocks(lambda c, w, b: max(c - w, 0) // b), "null block(s)")
    assert_rejected(check_null_blocks(lambda c, w: 0), "raised TypeError")


def test_null_blocks_has_a_random_block_size() -> None:
    # Right for the block sizes the notebook names (4 and 8) only: the random third run catches it.
    def only_4_and_8(c: int, w: int, b: int) -> int:
        return max(c - w + 1, 0) // b if b in (4, 8) else 0

    assert_rejected(check_null_blocks(only_4_and_8), "your function says 0")



def test_null_blocks_catches_a_window_written_in() -> None:
    # Right for tiny-hybrid's window only: the KV cache manager's run with another window catches it.
    def only_32(c: int, w: int, b: int) -> int:
        return max(c - 32 + 1, 0) // b

    assert_rejected(check_null_blocks(only_32), "null block(s), your function says")


@pytest.mark.parametrize("block_size, prompt_len", [(4, 40), (5, 57)])
def test_manager_window_rows_replay_the_engines_rows(block_size: int, prompt_len: int) -> None:
    """The checker's model-free run (any window) gives the engine's rows for tiny-hybrid's window."""
    engine = sliding_window_rows(block_size, prompt_len)
    replay = manager_window_rows(32, block_size, prompt_len)
    assert [(s.step, s.context_len, s.null_blocks, len(s.row)) for s in replay] == \
        [(s.step, s.context_len, s.null_blocks, len(s.row)) for s in engine]

# ---- 07: flash attention -------------------------------------------------------------------------


def test_kernel_block_rows() -> None:
    def right(row: list[int], block_size: int, kernel_block_size: int) -> list[int]:
        k = block_size // kernel_block_size
        return [b * k + i for b in row for i in range(k)]

    result = check_kernel_block_rows(right)
    assert result, result.message
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: [x + i for x in row for i in range(b // kb)]),
                    "returned [5, 6, 7, 1, 2, 3, 12, 13, 14], expected [15, 16, 17, 3, 4, 5, 36, 37, 38]")
    # The notebook's answer typed in as a constant passes only the notebook's case.
    assert_rejected(check_kernel_block_rows(lambda row, b, kb: [15, 16, 17, 3, 4, 5, 36, 37, 38]), "expected")
    assert_rejected(check_kernel_block_rows(to_kernel_block_table), "pagedkv's own to_kernel_block_table")
    assert_rejected(
        check_kernel_block_rows(lambda row, b, kb: to_kernel_block_table(torch.tensor([row]), b // kb)[0].tolist()),
        "calls pagedkv's own to_kernel_block_table",
    )
    assert_rejected(check_kernel_block_rows([15, 16, 17]), "function itself")
