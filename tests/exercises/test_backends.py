"""Checker of notebook 04 (attention backends): accepts a right backend written here, rejects the classic bugs with
the rule they break (never the right values), and rejects the package's own attention however it is reached
(inherited, called, called on a thread, or read from the checker's frames)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.attention.selector import unregister_backend
from pagedkv.exercises import reveal
from pagedkv.exercises.backends import check_backend
from tests.exercises.checks import (
    assert_rejected,
    notebook_cells,
    run_solution,
    saved_outputs_show_no_pass,
    worked_solutions,
)


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

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: _Meta | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
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
        ("TEST_REPEAT", {"interleave": False}, ["heads [1, 4] are wrong", "repeat_interleave"]),
        ("TEST_NEW_TENSOR", {"in_place": False}, ["new tensor", "output"]),
        ("TEST_SHIFTED", {"slot_shift": -1}, ["KV cache write is wrong", "slot_mapping"]),
        ("TEST_NO_WINDOW", {"windowed": False}, ["this layer has a sliding window of", "Mask the older keys"]),
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
        assert "every output matches float64 attention" in result.message
        assert "made-up steps" in result.message
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
        def forward(
            self,
            layer: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: Any,
            output: torch.Tensor,
        ) -> torch.Tensor:
            if attn_metadata is None:
                return output.zero_()
            return paged_attention_reference(
                query,
                *kv_cache.unbind(0),
                output,
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.block_table,
                self.scale,
            )

    class Wrapping(TorchRefImpl):  # overrides the work methods, but only to call the inherited ones
        def forward(self, *args: Any) -> torch.Tensor:
            return super().forward(*args)

        def do_kv_cache_update(self, *args: Any) -> None:
            super().do_kv_cache_update(*args)

    class TritonWrite(_Impl):  # its own attention, but the package's Triton kernel writes the cache
        def forward(
            self,
            layer: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: Any,
            output: torch.Tensor,
        ) -> torch.Tensor:
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
        assert_rejected(check_backend(delegating, device="cpu"), "Your answer calls paged_attention_reference")
        assert_rejected(check_backend(triton_write, device="cpu"), "Your answer calls reshape_and_cache")
        assert_rejected(check_backend(borrowed, device="cpu"), "inherits the do_kv_cache_update of TritonCacheWriter")
        assert_rejected(check_backend(WrappingBackend, device="cpu"), "Your answer calls TorchRefImpl.")
    finally:
        for name in ("TEST_RENAMED", "TEST_DELEGATING", "TEST_WRAPPING", "TEST_TRITON_WRITE", "TEST_BORROWED"):
            unregister_backend(name)


def test_backend_rejects_non_backends() -> None:
    assert_rejected(check_backend(42), "AttentionBackend subclass")
    assert_rejected(check_backend(_backend("TEST_X")()), "AttentionBackend subclass")  # an instance
    assert_rejected(check_backend(_backend("TORCH_REF")), "built-in backend's name")


def test_backend_rejects_the_reference_on_a_thread_and_frame_reading() -> None:
    from pagedkv.attention.backends.torch_ref import TorchRefImpl

    class OnAThread(_Impl):  # the answer: TORCH_REF's forward run on a worker thread
        def forward(
            self,
            layer: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: Any,
            output: torch.Tensor,
        ) -> torch.Tensor:
            if attn_metadata is None:
                return output.zero_()
            from pagedkv.attention.backends.torch_ref import TorchRefMetadata

            m = attn_metadata
            ref = TorchRefMetadata(
                m.slot_mapping.shape[0], m.query_start_loc, m.seq_lens, m.block_table, m.slot_mapping
            )
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)  # its own cache write
            pool = ThreadPoolExecutor(max_workers=1)
            return pool.submit(TorchRefImpl.forward, self, layer, query, key, value, kv_cache, ref, output).result()

    class ReadsTheChecker(_Impl):  # looks for the checker's answer up the stack
        def forward(self, *args: Any) -> torch.Tensor:
            frame = sys._getframe(1)
            return frame.f_locals.get("right", args[-1])

    on_a_thread, reads = _backend("TEST_THREAD"), _backend("TEST_FRAMES")
    on_a_thread.get_impl_cls = staticmethod(lambda: OnAThread)  # type: ignore[method-assign]
    reads.get_impl_cls = staticmethod(lambda: ReadsTheChecker)  # type: ignore[method-assign]
    try:
        assert_rejected(check_backend(on_a_thread, device="cpu"), "Your answer calls TorchRefImpl.forward")
        assert_rejected(check_backend(reads, device="cpu"), "reading the checker's frames")
    finally:
        unregister_backend("TEST_THREAD")
        unregister_backend("TEST_FRAMES")


def test_backend_message_holds_no_right_values_and_reveal_works_it_out(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        results = [check_backend(_backend("TEST_NO_MASK_AGAIN", causal=False), device="cpu") for _ in range(3)]
        assert "reveal()" not in results[1].message and "reveal()" in results[2].message
        assert "should start" not in results[2].message and "[" not in results[2].message.split("wrong.")[1][:40]
        reveal()
        worked = capsys.readouterr().out
        assert "04: a backend of your own, worked out" in worked
        assert "sees keys at positions 0 ..." in worked and "(causal)" in worked
        assert "head 0 should start" in worked and "query head h reads KV head h // 3" in worked
    finally:
        unregister_backend("TEST_NO_MASK_AGAIN")


def test_the_notebooks_worked_solution_passes_and_is_not_run() -> None:
    """The worked solution (NAIVE plus the window) sits in a collapsed markdown cell, not run by Run All, and
    passes the checker; no saved output shows a pass mark, so a pass on screen is the student's own."""
    cells = notebook_cells("04_attention_backends.ipynb")
    (solution,) = worked_solutions("04_attention_backends.ipynb")
    naive = [
        "".join(c["source"])
        for c in cells
        if c["cell_type"] == "code"
        and any(f"class Naive{n}" in "".join(c["source"]) for n in ("Metadata", "Impl", "Backend"))
    ]
    namespace: dict[str, Any] = {"check_backend": check_backend, "torch": torch}
    try:
        for source in naive:
            exec(source, namespace)  # noqa: S102
        assert run_solution(solution, namespace)
    finally:
        unregister_backend("NAIVE")
        unregister_backend("WINDOWED")
    assert saved_outputs_show_no_pass("04_attention_backends.ipynb")
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert all(
        "enable_prefix_caching=False" in line or "LLM(" not in line or "def " in line
        for line in source.replace(",\n", ", ").splitlines()
    )


class _LyingTensor(torch.Tensor):
    """A tensor class whose comparisons say "equal": a backend gives it to the engine's tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.allclose, torch.equal):
            return True
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.isclose, torch.isfinite, torch.Tensor.isfinite):
            return torch.ones(torch.Tensor.size(result), dtype=torch.bool)  # a plain tensor: all close, all finite
        return result


class _LyingImpl(_Impl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):  # type: ignore[no-untyped-def]
        output.__class__ = kv_cache.__class__ = _LyingTensor  # writes nothing: only says it is right
        return output


def test_backend_rejects_a_class_given_to_the_engines_tensors() -> None:
    backend = _backend("TEST_LYING")
    backend.get_impl_cls = staticmethod(lambda: _LyingImpl)  # type: ignore[method-assign]
    try:
        assert_rejected(check_backend(backend, device="cpu"), "your backend made `output` a _LyingTensor")
    finally:
        unregister_backend("TEST_LYING")
