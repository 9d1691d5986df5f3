"""FLASH_ATTN: the flash-attn kernels over the paged cache, when the package is installed.

Two generations read a paged cache differently:

    flash-attn 4 (`flash_attn.cute`, Hopper and newer)   page_table [reqs, pages] + seqused_k
                                                          pages of any size (multiple of 16 here)
    flash-attn 2 (`flash_attn`, Ampere and newer)         block_table [reqs, pages] + cu_seqlens_k
                                                          pages must be a multiple of 256 tokens

Both take the query tokens of all requests packed back to back (`cu_seqlens_q`), so one call
serves prefill, decode and mixed batches. Neither writes into a given output tensor through
its public function, so `forward` copies the result into `output`.

CUDA graphs: a call reads every length from device tensors; the host-side integers
(`max_seqlen_q`, `max_seqlen_k`, the split count) are fixed upper bounds in a captured graph
(`build_for_cudagraph_capture`), and nothing is derived per call on the host. flash-attn 4
JIT-compiles a kernel the first time it meets a new configuration: the runner runs every
captured batch once eagerly, with the same metadata, before capturing it, so no compilation
(or module loading) happens inside a capture.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from pagedkv.attention.backends.triton_attn import TritonCacheWriter, cudagraph_capture_bounds
from pagedkv.config import EngineConfig
from pagedkv.kernels import HAS_TRITON
from pagedkv.kv_cache.fp8 import is_fp8
from pagedkv.kv_cache.spec import KVCacheSpec


@functools.lru_cache(maxsize=None)
def flash_attn_version() -> int | None:
    """4 if flash-attn 4 can run here (installed, GPU of compute capability >= 9.0), else 2 if
    flash-attn 2 is installed, else None. Only looks for the packages; importing comes later."""
    has_fa4 = (
        importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None
    )
    if has_fa4 and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        return 4
    if importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec(
        "flash_attn.flash_attn_interface"
    ):
        return 2
    return None


def _varlen_func(version: int) -> Callable[..., Any]:
    module = importlib.import_module("flash_attn.cute" if version == 4 else "flash_attn")
    varlen_func: Callable[..., Any] = module.flash_attn_varlen_func  # flash_attn has no type hints
    return varlen_func


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    """flash-attn 2 only: prefix sums of seq_lens, [num_reqs + 1]."""
    block_table: torch.Tensor
    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Repackages the common metadata; flash-attn 2 also needs the key prefix sums."""

    # Any batch, mixed prefill + decode included: lengths live in device tensors and the host
    # bounds of a capture hold for every replay. Checked for flash-attn 4 on the GPU by
    # tests/gpu/test_cudagraph_cuda.py (capture, then replay with other lengths and pages).
    cudagraph_support = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        config: EngineConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.cu_seqlens_k: torch.Tensor | None = None
        """flash-attn 2: the key prefix sums, rewritten in place by every build so that a
        captured graph reads this step's values (a fresh tensor per build would be stale)."""
        if flash_attn_version() == 2:
            # Not run with graphs on the test machine (flash-attn 2 is not installed there):
            # declare what vLLM declares for flash-attn 2.
            self.cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
            max_reqs = config.scheduler_config.max_num_seqs
            self.cu_seqlens_k = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        cm = common_attn_metadata
        return self._metadata(cm, cm.max_query_len, cm.max_seq_len)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        """Host-side bounds must cover every replay (`cudagraph_capture_bounds`)."""
        cm = common_attn_metadata
        return self._metadata(cm, *cudagraph_capture_bounds(cm, self.config.model_config.max_model_len))

    def _metadata(self, cm: CommonAttentionMetadata, max_query_len: int, max_seq_len: int) -> FlashAttentionMetadata:
        cu_seqlens_k = None
        if self.cu_seqlens_k is not None:
            cu_seqlens_k = self.cu_seqlens_k[: cm.seq_lens.shape[0] + 1]
            torch.cumsum(cm.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            cu_seqlens_k=cu_seqlens_k,
            block_table=cm.block_table_tensor,
            causal=cm.causal,
        )


class FlashAttentionImpl(TritonCacheWriter, AttentionImpl[FlashAttentionMetadata]):
    """Scatter with `reshape_and_cache`, attend with flash-attn's varlen function."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        version = flash_attn_version()
        if version is None:
            raise RuntimeError("FLASH_ATTN needs flash-attn 4 (flash_attn.cute) or flash-attn 2 installed")
        self.version = version
        self.varlen = _varlen_func(version)
        # Both take the window as (left, right): a query sees `left` earlier keys and itself.
        self.window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profile run: shapes only
            return output.zero_()
        m = attn_metadata
        if not m.causal:
            raise NotImplementedError("FLASH_ATTN here implements causal (decoder) attention only")
        k_cache, v_cache = self._kv_views(kv_cache)
        n = m.num_actual_tokens
        # The two versions name the keys' lengths and pages differently; the rest they take alike.
        per_version: dict[str, Any]
        if self.version == 4:
            per_version = dict(
                seqused_k=m.seq_lens,
                page_table=m.block_table,
                window_size=(None, None) if self.sliding_window is None else self.window,
                num_splits=1,  # no split heuristic on host values (and SM 9.0 has no split-KV)
            )
        else:
            per_version = dict(cu_seqlens_k=m.cu_seqlens_k, block_table=m.block_table, window_size=self.window)
        result = self.varlen(
            query[:n],
            k_cache,
            v_cache,
            cu_seqlens_q=m.query_start_loc,
            max_seqlen_q=m.max_query_len,
            max_seqlen_k=m.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            **per_version,
        )
        output[:n].copy_(result[0] if isinstance(result, tuple) else result)
        return output


class FlashAttentionBackend(AttentionBackend):
    """flash-attn 4 on Hopper+ (any multiple of 16 tokens per block), else flash-attn 2."""

    forward_includes_kv_cache_update = False
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = supported_dtypes
    supported_devices = ("cuda",)

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(256)] if flash_attn_version() == 2 else [MultipleOf(16)]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if flash_attn_version() is None:
            if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
                return "flash-attn 4 needs a GPU of compute capability 9.0 or newer (Hopper)"
            return "flash_attn is not installed (neither flash-attn 4 `flash_attn.cute` nor flash-attn 2)"
        if not HAS_TRITON:
            return "triton is not installed (the KV cache scatter is a Triton kernel)"
        return None

    @classmethod
    def extra_reasons(
        cls, *, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype, device_type: str
    ) -> list[str]:
        reasons = []
        if device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA required, but no CUDA device is visible")
        if not (head_size % 8 == 0 and 8 <= head_size <= 256):
            reasons.append(f"head size {head_size} not supported (a multiple of 8 up to 256)")
        if is_fp8(kv_cache_dtype):
            reasons.append(
                "an fp8 KV cache needs flash-attn 4's fp8 path, which runs on Blackwell (sm_100) only; "
                "TRITON_ATTN reads an fp8 cache on any GPU"
            )
        return reasons
