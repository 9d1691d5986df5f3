"""Engine configuration: one dataclass per concern, bundled in `EngineConfig`.

Layers read the config that is *current* while the model is being built
(`set_current_engine_config`), the way vLLM layers read `get_current_vllm_config()`:
a model file never has to pass the config down through every constructor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.compilation.modes import CUDAGraphMode  # a leaf module (re-exported): no import cycle


@dataclass
class ModelConfig:
    """Which model, in which dtype, and how long a sequence may get."""

    model: str
    """A preset name (`pagedkv.models.loader.PRESETS`) or a local Hugging Face model directory."""
    dtype: torch.dtype = torch.float32
    max_model_len: int = 2048
    """Longest sequence (prompt + generated tokens) the engine accepts."""
    seed: int = 0
    """Seed for random-init presets."""


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks."""

    block_size: int = 16
    """Tokens per KV cache block (a page)."""
    num_kv_blocks: int | None = None
    """Blocks per KV cache group; None sizes the cache from `memory_utilization` / `kv_cache_memory`."""
    cache_dtype: str = "auto"
    """"auto" stores K/V in the model dtype; otherwise a torch dtype name such as "float16"."""
    memory_utilization: float = 0.9
    """CUDA only: fraction of total GPU memory the engine may use (weights + activations + KV)."""
    kv_cache_memory: int | None = None
    """Explicit KV cache budget in bytes (overrides `memory_utilization`; CPU default 64 MiB)."""


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps when it does not fit the token budget."""
    async_scheduling: bool = False
    """Plan and launch the next step before the host has read this step's tokens
    (pagedkv/engine/scheduler.py); `EngineArgs` turns it on with CUDA."""


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many processes (ranks) each hold a shard of the model."""

    tensor_parallel_size: int = 1
    """1: one process. N > 1: the driver is rank 0 and N - 1 worker processes run every step with it
    (pagedkv/worker/tp_executor.py); each rank holds its query heads, its (or a replicated) KV head
    and its share of every matrix (pagedkv/models/parallel_layers.py)."""


@dataclass
class CompilationConfig:
    """What layers publish by name, and how steps may be compiled / captured."""

    static_forward_context: dict[str, Any] = field(default_factory=dict)
    """Map from layer name to the layer objects that must be reachable outside model code."""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    """What the runner tries to capture; lowered at start-up to what the attention backends
    and the device allow (`ModelRunner.capture_model`). `LLM` picks a device default."""
    splitting_ops: list[str] = field(
        default_factory=lambda: [
            "pagedkv::unified_attention_with_output",
            "pagedkv::unified_kv_cache_update",
            "pagedkv::unified_mla_attention_with_output",
            "pagedkv::unified_mla_kv_cache_update",
        ]
    )
    """Ops the compiled graph is cut at; they run eagerly between the compiled pieces."""
    compile: bool = False
    """Trace the model's forward once with torch.compile and split it at `splitting_ops`
    (`pagedkv.compilation.compile_model`)."""
    piece_compiler: str | None = None
    """How each piece between splitting ops is compiled: "inductor", or "eager" (the traced
    FX code run as Python: cheap, for CPU tests). None: inductor on CUDA, eager elsewhere."""
    opaque_attention_op: bool | None = None
    """Call attention through the `torch.ops.pagedkv` custom ops (True) or directly (False).
    None asks the platform."""
    enforce_eager: bool = False
    """Run every step eagerly, whatever `cudagraph_mode` says (no graph is captured)."""
    cudagraph_capture_sizes: list[int] | None = None
    """Padded token counts that get graphs. None: [1, 2, 4] and every multiple of 8 up to
    `max_cudagraph_capture_size`."""
    max_cudagraph_capture_size: int | None = None
    """Largest default capture size. None: min(2 * max_num_seqs, 512); never more than
    `max_num_batched_tokens` (no step is larger)."""


@dataclass
class EngineConfig:
    """Everything an engine needs, in one object."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    attention_backend: str | None = None
    """Backend name forced for every layer (else chosen per layer by the selector)."""
    layer_attention_backends: dict[str, str] = field(default_factory=dict)
    """Layer name -> backend name for single layers; wins over `attention_backend`. Layers of one
    KV cache group on different backends form separate attention groups (one builder each)."""

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        if self.cache_config.cache_dtype == "auto":
            return self.model_config.dtype
        return parse_dtype(self.cache_config.cache_dtype)


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept a torch dtype or a name such as "bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.")
    return _DTYPES[dtype]


_current_config: EngineConfig | None = None


@contextlib.contextmanager
def set_current_engine_config(config: EngineConfig) -> Iterator[None]:
    """Make `config` visible to layers constructed inside the `with` block."""
    global _current_config
    previous, _current_config = _current_config, config
    try:
        yield
    finally:
        _current_config = previous


def get_current_engine_config() -> EngineConfig:
    """The config of the model being built, or a CPU default one for stand-alone layers."""
    global _current_config
    if _current_config is None:
        _current_config = EngineConfig(ModelConfig(model="standalone"))
    return _current_config
