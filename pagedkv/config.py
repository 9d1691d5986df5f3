"""Engine configuration: one dataclass per concern, bundled in `EngineConfig`.

Layers read the config that is *current* while the model is being built
(`set_current_engine_config`), the way vLLM layers read `get_current_vllm_config()`:
a model file never has to pass the config down through every constructor.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


class CUDAGraphMode(enum.Enum):
    """How a step is run: eagerly, as piecewise graphs between attention ops, or one full graph.

    A mode is a pair of routines, one for batches where every request decodes a single
    token (uniform decode) and one for everything else (mixed prefill + decode):

        mode                 decode routine   mixed routine
        NONE                 NONE             NONE          every step eager
        PIECEWISE            PIECEWISE        PIECEWISE     graphs between the attention ops
        FULL                 FULL             FULL          one graph for the whole model
        FULL_DECODE_ONLY     FULL             NONE
        FULL_AND_PIECEWISE   FULL             PIECEWISE

    NONE, PIECEWISE and FULL are also the *runtime* modes a single step runs in; the two
    combined modes only say which of those a decode step and a mixed step get. (vLLM keeps
    it in vllm/config/compilation.py, beside the compilation config that holds it.)
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    def decode_mode(self) -> CUDAGraphMode:
        """The routine of uniform-decode batches (every request one query token)."""
        return _ROUTINES[self][0]

    def mixed_mode(self) -> CUDAGraphMode:
        """The routine of every other batch (prefills, chunks, mixed prefill + decode)."""
        return _ROUTINES[self][1]

    def has_full_cudagraphs(self) -> bool:
        """Some batches replay one graph of the whole model (attention included)."""
        return CUDAGraphMode.FULL in _ROUTINES[self]

    def requires_piecewise_compilation(self) -> bool:
        """Some batches run piecewise graphs, which only exist when attention is split out."""
        return CUDAGraphMode.PIECEWISE in _ROUTINES[self]

    def without_piecewise(self) -> CUDAGraphMode:
        """The same mode with its piecewise routine run eagerly (PIECEWISE -> NONE,
        FULL_AND_PIECEWISE -> FULL_DECODE_ONLY); other modes are returned unchanged."""
        decode, mixed = (CUDAGraphMode.NONE if r is CUDAGraphMode.PIECEWISE else r for r in _ROUTINES[self])
        return CUDAGraphMode.from_routines(decode, mixed)

    @classmethod
    def from_routines(cls, decode: CUDAGraphMode, mixed: CUDAGraphMode) -> CUDAGraphMode:
        """The mode whose (decode, mixed) routines are the given pair."""
        for mode, routines in _ROUTINES.items():
            if routines == (decode, mixed):
                return mode
        raise ValueError(
            f"No CUDAGraphMode runs decode batches as {decode.name} and mixed batches as {mixed.name}; "
            f"the pairs are {', '.join(f'{m.name}={tuple(r.name for r in rs)}' for m, rs in _ROUTINES.items())}."
        )

    @classmethod
    def parse(cls, value: CUDAGraphMode | str) -> CUDAGraphMode:
        """A mode, or its name in any case ("full_and_piecewise")."""
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"Unknown cudagraph_mode {value!r}; use a CUDAGraphMode or one of {list(cls.__members__)}.")


_ROUTINES: dict[CUDAGraphMode, tuple[CUDAGraphMode, CUDAGraphMode]] = {
    CUDAGraphMode.NONE: (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
    CUDAGraphMode.PIECEWISE: (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
    CUDAGraphMode.FULL: (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
    CUDAGraphMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    CUDAGraphMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
}
"""mode -> (decode routine, mixed routine): the table in `CUDAGraphMode`'s docstring."""


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
    batch_invariant: bool = False
    """Every reduction of a token's computation (matmuls, norms, attention, softmax) in an order that does
    not depend on the rest of the batch, so a request's logits are bitwise the same alone or batched,
    chunked or cached (pagedkv/batch_invariant.py; vLLM's VLLM_BATCH_INVARIANT)."""


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks."""

    block_size: int = 16
    """Tokens per KV cache block (a page)."""
    num_kv_blocks: int | None = None
    """Blocks per KV cache group; None sizes the cache from `gpu_memory_utilization` / `kv_cache_memory`."""
    cache_dtype: str = "auto"
    """"auto" stores K/V in the model dtype; "fp8" / "fp8_e4m3" in float8_e4m3fn with a scale per layer
    (pagedkv/kv_cache/fp8.py); otherwise a torch dtype name such as "float16"."""
    kv_cache_scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    """An fp8 cache: attention layer name -> its given (k_scale, v_scale); the layers not named keep 1.0,
    or with `calculate_kv_scales` get theirs from the profile run's K and V (pagedkv/kv_cache/fp8.py)."""
    calculate_kv_scales: bool = False
    """An fp8 cache: set the scales of the layers `kv_cache_scales` does not name from the profile run's K
    and V (amax / 200, amax / 100) instead of leaving them 1.0 (vllm/config/cache.py, calculate_kv_scales)."""
    gpu_memory_utilization: float = 0.9
    """CUDA only: fraction of total GPU memory the engine may use (weights + activations + KV)."""
    kv_cache_memory: int | None = None
    """Explicit KV cache budget in bytes (overrides `gpu_memory_utilization`; CPU default 64 MiB)."""


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


ATTENTION_OPS: tuple[str, ...] = (
    "pagedkv::unified_attention_with_output",
    "pagedkv::unified_kv_cache_update",
    "pagedkv::unified_mla_attention_with_output",
    "pagedkv::unified_mla_kv_cache_update",
)
"""The attention custom ops (pagedkv/attention/ops.py, pagedkv/attention/mla/ops.py), qualified.

Spelled once here, the lowest layer, so that the default `splitting_ops` and the compiler's check
that attention is split out (pagedkv/compilation/wrapper.py) read the same names; vLLM likewise
lists its attention ops in one place (vllm/config/compilation.py, `_attention_ops`)."""


@dataclass
class CompilationConfig:
    """What layers publish by name, and how steps may be compiled / captured."""

    static_forward_context: dict[str, Any] = field(default_factory=dict)
    """Map from layer name to the layer objects that must be reachable outside model code."""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    """What the runner tries to capture; lowered at start-up to what the attention backends
    and the device allow (`ModelRunner.capture_model`). `LLM` picks a device default."""
    splitting_ops: list[str] = field(default_factory=lambda: list(ATTENTION_OPS))
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
    """Largest default capture size. None: min(2 * max_num_seqs * (1 + speculative tokens), 512); never more than
    `max_num_batched_tokens` (no step is larger)."""


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""The proposers: prompt lookup in the request's own tokens, or a smaller model run in the same engine."""


@dataclass
class SpeculativeConfig:
    """Speculative decoding: propose k tokens cheaply, verify them in one target pass of 1 + k tokens.

    Field names are vLLM's (vllm/config/speculative.py), so `speculative_config` dicts carry over.
    """

    method: str
    """"ngram" (prompt lookup: the tokens that followed the last n-gram's earlier occurrence) or
    "draft_model" (a small model of the same vocabulary proposes greedily)."""
    num_speculative_tokens: int
    """k: drafts proposed per decoding request and step; a step verifies up to 1 + k tokens each."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram looked up."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n-gram looked up (the longest that matches wins)."""
    model: str | None = None
    """draft_model: a preset name or a local model directory (its vocabulary must be the target's)."""

    @property
    def uniform_decode_query_len(self) -> int:
        """Query tokens of a decoding request that got all its drafts: 1 + k."""
        return 1 + self.num_speculative_tokens


@dataclass
class EngineConfig:
    """Everything an engine needs, in one object."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, or None (one new token per decoding request and step)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    attention_backend: str | None = None
    """Backend name forced for every layer (else chosen per layer by the selector)."""
    layer_attention_backends: dict[str, str] = field(default_factory=dict)
    """Layer name -> backend name for single layers; wins over `attention_backend`. Layers of one
    KV cache group on different backends form separate attention groups (one builder each)."""

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return parse_kv_cache_dtype(self.cache_config.cache_dtype, self.model_config.dtype)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept a torch dtype or a name such as "bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.")
    return _DTYPES[dtype]


FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""The `kv_cache_dtype` names of an fp8 cache (vLLM's); both are e4m3 (fp8_e5m2 is not implemented;
pagedkv/kv_cache/fp8.py holds what e4m3 can represent)."""


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: "auto" (the model's), "fp8" / "fp8_e4m3" (float8_e4m3fn), or a dtype name."""
    if name == "auto":
        return model_dtype
    if name in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[name]
    if name not in _DTYPES:
        raise ValueError(
            f"Unknown kv_cache_dtype {name!r}; use 'auto', one of {sorted(FP8_KV_CACHE_DTYPES)} or {sorted(_DTYPES)}."
        )
    return _DTYPES[name]


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
