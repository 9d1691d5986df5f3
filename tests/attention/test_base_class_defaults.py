"""What a backend gets from the base classes when it writes only the abstract methods.

vLLM's base classes (vllm/v1/attention/backend.py) promise three defaults a new backend
relies on without writing a line: its builder allows no CUDA graph capture
(`cudagraph_support = NEVER`), builds a captured dummy batch's metadata with its ordinary
`build`, and its forward writes the new K/V itself (`forward_includes_kv_cache_update = True`),
so the layer never calls `do_kv_cache_update`. The backend below defines only `get_name`,
`get_impl_cls`, `get_builder_cls`, `build` and `forward`; the tests run it in the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedkv.attention.backends.torch_ref import TorchRefImpl, TorchRefMetadata, TorchRefMetadataBuilder
from pagedkv.attention.selector import register_backend, unregister_backend
from pagedkv.config import CUDAGraphMode
from pagedkv.worker.attn_utils import min_cudagraph_support
from tests.reference import generate_checked

PROMPTS = [{"prompt_token_ids": [4, 5, 6]}, {"prompt_token_ids": [7, 8]}]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class MinimalBuilder(AttentionMetadataBuilder[TorchRefMetadata]):
    """`build` only (TORCH_REF's)."""

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> TorchRefMetadata:
        return TorchRefMetadataBuilder.build(self, common_attn_metadata)  # type: ignore[arg-type]


class WritesInForwardImpl(AttentionImpl[TorchRefMetadata]):
    """`forward` only: the cache write and TORCH_REF's attention in one call; no
    `do_kv_cache_update` of its own, so the base class's raises if the layer calls it."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):  # type: ignore[no-untyped-def]
        if attn_metadata is not None:
            TorchRefImpl.do_kv_cache_update(self, layer, key, value, kv_cache, attn_metadata.slot_mapping)  # type: ignore[arg-type]
        return TorchRefImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output)  # type: ignore[arg-type]


class MinimalBackend(AttentionBackend):
    supported_devices = ("cpu",)

    @staticmethod
    def get_name() -> str:
        return "MINIMAL"

    @staticmethod
    def get_impl_cls() -> type[WritesInForwardImpl]:
        return WritesInForwardImpl

    @staticmethod
    def get_builder_cls() -> type[MinimalBuilder]:
        return MinimalBuilder


@pytest.fixture
def minimal() -> Iterator[type[MinimalBackend]]:
    register_backend(MinimalBackend)
    try:
        yield MinimalBackend
    finally:
        unregister_backend("MINIMAL")


def test_forward_writes_the_cache_so_the_layer_never_calls_do_kv_cache_update(minimal) -> None:
    """Logits against the float64 reference: the K/V of earlier steps were written (by forward
    alone: the base `do_kv_cache_update` raises if anything calls it)."""
    llm = LLM("tiny", device="cpu", attention_backend="MINIMAL", num_kv_blocks=8)
    generate_checked(llm, PROMPTS, GREEDY)


def test_the_layer_calls_do_kv_cache_update_once_the_backend_says_forward_does_not(minimal) -> None:
    """The other side of the same flag, so the test above can fail: told that forward does not
    write, the layer calls the base class's `do_kv_cache_update`, which names the broken promise."""
    minimal.forward_includes_kv_cache_update = False
    try:
        llm = LLM("tiny", device="cpu", attention_backend="MINIMAL", num_kv_blocks=8, enforce_eager=True)
        with pytest.raises(
            NotImplementedError, match="WritesInForwardImpl sets forward_includes_kv_cache_update=False"
        ):
            llm.generate(PROMPTS, GREEDY)
    finally:
        del minimal.forward_includes_kv_cache_update


def test_no_cudagraph_support_lowers_full_decode_graphs_to_piecewise(minimal) -> None:
    """NEVER is what the runner reads off the builder; the GPU default mode (FULL_AND_PIECEWISE)
    then keeps no FULL routine (rule 3 of pagedkv/compilation/resolve.py; on a CPU the device
    then turns graphs off, but the runner records what the backends' rules made of the mode)."""
    llm = LLM(
        "tiny",
        device="cpu",
        attention_backend="MINIMAL",
        num_kv_blocks=8,
        compile=True,
        cudagraph_mode="FULL_AND_PIECEWISE",
    )
    assert MinimalBuilder.cudagraph_support is AttentionCGSupport.NEVER
    assert min_cudagraph_support(llm.runner.attn_groups) == (AttentionCGSupport.NEVER, "MINIMAL")
    resolution = llm.runner.cudagraph_resolution
    assert resolution is not None and resolution.configured is CUDAGraphMode.FULL_AND_PIECEWISE
    assert resolution.resolved is CUDAGraphMode.PIECEWISE


def test_capture_metadata_is_the_ordinary_build(minimal) -> None:
    """`build_for_cudagraph_capture` falls back to `build`: one more build, the same metadata."""
    seen: list[CommonAttentionMetadata] = []
    original = MinimalBuilder.build

    def recording_build(self: MinimalBuilder, common: CommonAttentionMetadata) -> TorchRefMetadata:
        seen.append(common)
        return original(self, common)

    MinimalBuilder.build = recording_build  # type: ignore[method-assign]
    try:
        llm = LLM("tiny", device="cpu", attention_backend="MINIMAL", num_kv_blocks=8)
        llm.generate(PROMPTS, GREEDY)  # real steps, for a real CommonAttentionMetadata
        builder = llm.runner.attn_groups[0][0].metadata_builder
        assert builder is not None and seen
        common, builds = seen[0], len(seen)
        ordinary, captured = builder.build(common), builder.build_for_cudagraph_capture(common)
    finally:
        MinimalBuilder.build = original  # type: ignore[method-assign]
    assert len(seen) == builds + 2 and seen[-1] is common
    assert captured.query_start_loc_cpu == ordinary.query_start_loc_cpu == common.query_start_loc_cpu.tolist()
    assert captured.seq_lens_cpu == ordinary.seq_lens_cpu
    assert captured.slot_mapping is ordinary.slot_mapping is common.slot_mapping
