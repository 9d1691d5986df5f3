"""The backend trio and the metadata every backend starts from.

    AttentionBackend         class, static methods only: names the other two, answers
                             "do you support head size 96? bf16? block size 16?"
    AttentionMetadataBuilder one per attention group, made at start-up; each step turns
                             the CommonAttentionMetadata into the backend's own metadata
    AttentionImpl            one per layer, made in the layer's constructor; each step
                             writes new K/V into the cache and runs the kernel

Metadata depends on the batch, not on the layer: a 32-layer model builds it once per
group and step, and every layer of the group reads the same object.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch

from pagedkv.kv_cache.fp8 import is_fp8

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig
    from pagedkv.kv_cache.spec import KVCacheSpec


class AttentionType(str, enum.Enum):
    """Which tokens attend to which: causal decoder self-attention, or bidirectional."""

    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class AttentionCGSupport(enum.Enum):
    """How much CUDA graph capture a metadata builder allows (the runner keeps the weakest)."""

    ALWAYS = 3
    """Full graphs for any batch, mixed prefill + decode included."""
    UNIFORM_BATCH = 2
    """Full graphs only when every request has the same query length (spec-decode)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Full graphs only for pure decode batches (query length 1)."""
    NEVER = 0
    """No full graphs: attention must run eagerly."""


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block size constraint: any multiple of `base`."""

    base: int


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step's batch, built once per KV cache group.

    For request i, ordered decodes first::

        |---------- step N-1 --------|
        |---------------- step N -----------------|
        |--- context_len (cached) ---|-- query_len --|
        |----------------- seq_len ------------------|

    query tokens of all requests are packed back to back:
    tokens of request i are `query_start_loc[i] : query_start_loc[i + 1]`.
    """

    query_start_loc: torch.Tensor
    """int32 [num_reqs + 1] on the device: prefix sums of query lengths."""
    query_start_loc_cpu: torch.Tensor
    """The same on the CPU (host-side loops read it without a device sync)."""
    seq_lens: torch.Tensor
    """int32 [num_reqs] on the device: context_len + query_len per request."""
    seq_lens_cpu: torch.Tensor
    """The same on the CPU."""
    num_reqs: int
    num_actual_tokens: int
    """Tokens in the step, padding excluded."""
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    """int32 [num_reqs, max_blocks_per_req]: logical block j of request i -> physical block."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: flat cache slot each new token is written to (-1 = padding)."""
    causal: bool = True
    uniform_decode: bool = False
    """Every request is a decode of the same query length (1 + speculative tokens): a FULL graph
    captured for such a batch is replayed only for such batches, so its bounds may be that length."""

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        return self.seq_lens_cpu - self.query_lens_cpu


class AttentionLayer(Protocol):
    """What an impl may read from the layer that calls it."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    _k_scale: torch.Tensor
    _v_scale: torch.Tensor
    """An fp8 KV cache's float32 scales (stored * scale = value); 1.0 otherwise."""


M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns CommonAttentionMetadata into one backend's metadata; one per attention group."""

    cudagraph_support: AttentionCGSupport = AttentionCGSupport.NEVER
    """What CUDA graphs this builder's metadata allows. A class attribute, not a ClassVar: a builder may
    narrow it per instance (FLASH_ATTN with flash-attn 2); the runner reads it from its builders."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        config: EngineConfig,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.config = config
        self.device = device

    @abstractmethod
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Build this step's metadata. Called once per attention group per step."""

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Build metadata for a dummy batch being captured; by default just `build`."""
        return self.build(common_attn_metadata)


class AttentionImpl(ABC, Generic[M]):
    """Runs attention for one layer: writes new K/V into the cache, then attends over it."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
        kv_cache_dtype: torch.dtype,
        attn_type: AttentionType = AttentionType.DECODER,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write attention of `query` [tokens, heads, head_size] into `output` and return it.

        `attn_metadata` is None in the profile run: fill `output` with zeros.
        """

    def kv_scales(self, layer: AttentionLayer) -> dict[str, torch.Tensor]:
        """`k_scale` / `v_scale` keywords for the kernels: the layer's scales with an fp8 cache, else none."""
        return dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if is_fp8(self.kv_cache_dtype) else {}

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter this step's K/V into their slots (backends whose forward does not)."""
        raise NotImplementedError(
            f"{type(self).__name__} sets forward_includes_kv_cache_update=False "
            "but does not implement do_kv_cache_update."
        )


class AttentionBackend(ABC):
    """A backend's rule book: names its builder and impl and says what it supports.

    Only static and class methods: nothing here holds state.
    """

    forward_includes_kv_cache_update: ClassVar[bool] = True
    """False when the layer must call `do_kv_cache_update` (a separate op) before `forward`."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = supported_dtypes
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = True
    is_mla: ClassVar[bool] = False
    """Serves multi-head latent attention layers (a latent cache, `MLAAttention`) instead of
    MHA / GQA / MQA ones; the selector matches the two."""

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]: ...

    @classmethod
    def full_cls_name(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        """Empty list: any head size."""
        return []

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        """Block sizes the kernel can read. The KV cache manager's size may be a multiple of one."""
        return [MultipleOf(1)]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Per-layer cache layout: K and V stacked, then pages of `block_size` tokens."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot run at all here (missing package), or None."""
        return None

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """Whether its metadata builder and kernels compute a query row the same way in every batch
        (`ModelConfig.batch_invariant`): no split-KV or tile choice made from the batch's shape.
        An engine in the batch-invariant mode refuses a backend that does not (vLLM's
        AttentionBackend.supports_batch_invariance, checked under VLLM_BATCH_INVARIANT)."""
        return False

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        for size in cls.get_supported_kernel_block_sizes():
            base = size.base if isinstance(size, MultipleOf) else size
            if block_size % base == 0:
                return True
        return False

    @classmethod
    def validate_configuration(
        cls,
        *,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        block_size: int,
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        device_type: str = "cpu",
        use_mla: bool = False,
    ) -> list[str]:
        """Every reason this backend cannot serve a layer of this shape; empty means it can."""
        reasons: list[str] = []
        if use_mla != cls.is_mla:
            reasons.append(
                "the layer uses MLA (a latent KV cache); this backend serves MHA/GQA/MQA layers only"
                if use_mla
                else "an MLA backend serves MLA layers only; this layer is MHA/GQA/MQA"
            )
        if device_type not in cls.supported_devices:
            hint = ""
            if cls.supported_devices is AttentionBackend.supported_devices:  # the default, which a writer may not know
                hint = (
                    f"; {cls.__name__} inherits AttentionBackend.supported_devices = ('cuda',): set "
                    f"supported_devices = ('cuda', {device_type!r}) on the class if it runs there"
                )
            reasons.append(f"device {device_type!r} not supported (needs one of {list(cls.supported_devices)}){hint}")
        unavailable = cls.unavailable_reason()
        if unavailable:
            reasons.append(unavailable)
        head_sizes = cls.get_supported_head_sizes()
        if head_sizes and head_size not in head_sizes:
            reasons.append(f"head size {head_size} not supported (supported: {head_sizes})")
        if dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype} not supported (supported: {list(cls.supported_dtypes)})")
        if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"KV cache dtype {kv_cache_dtype} not supported (supported: {list(cls.supported_kv_cache_dtypes)})"
            )
        if not cls.supports_block_size(block_size):
            reasons.append(
                f"block size {block_size} not supported (kernel block sizes: {cls.get_supported_kernel_block_sizes()})"
            )
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type.value!r} not supported (decoder only)")
        if sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        return reasons + cls.extra_reasons(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device_type=device_type
        )

    @classmethod
    def extra_reasons(
        cls, *, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype, device_type: str
    ) -> list[str]:
        """Backend-specific refusals beyond the declared lists above (a kernel's own limits)."""
        return []
