"""CUDA graphs for the model runner: capture sizes, the dispatcher, one graph wrapper.

A CUDA graph records a fixed sequence of kernel launches, with fixed tensor addresses and
fixed launch shapes, and replays it with one call. So a step can only replay a graph that
was captured for its *shape*, with its inputs copied into the tensors the graph reads:

    capture sizes   [1, 2, 4, 8, 16, 24, ...]        token counts that get graphs
    a step of 5 tokens  ->  padded to 8:  input_ids [a b c d e 0 0 0], slots [.. .. .. .. .. -1 -1 -1]
    dispatcher      (8 tokens, uniform decode?)  ->  FULL, else PIECEWISE, else NONE (eager)

    FULL       one graph of the whole model (attention included), replayed without running
               any Python of the model: the forward context is *not* set. What the layers
               looked up at capture (metadata objects, their tensors) is baked in, so every
               tensor they hold must be a persistent buffer rewritten in place each step.
    PIECEWISE  the compiled model (split at the attention ops) with one graph per piece and
               size; attention runs eagerly between the pieces with this step's metadata.
    NONE       the model runs as it is, unpadded.

One wrapper class serves both levels (`CUDAGraphWrapper`): around the whole model for FULL
and around every compiled piece for PIECEWISE. It obeys the forward context: it captures or
replays when the context's runtime mode is its own, and otherwise just calls what it wraps.
All graphs of a runner share one memory pool; a graph keeps only a non-owning view of its
outputs, so the pieces' intermediate tensors reuse the same memory across pieces and sizes
(replays run in the order the captures did, so nothing is read after being reused).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import torch
from torch.utils._pytree import tree_map_only

from pagedkv.compilation import resolve_cudagraph_mode
from pagedkv.compilation.backend import CompiledPiece, PieceWrapper
from pagedkv.compilation.resolve import Resolution, resolve_explained
from pagedkv.compilation.wrapper import attention_compiled_piecewise
from pagedkv.config import CUDAGraphMode, EngineConfig
from pagedkv.forward_context import BatchDescriptor, get_forward_context
from pagedkv.worker.attn_utils import AttentionGroup, min_cudagraph_support

logger = logging.getLogger("pagedkv")

MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """[1, 2, 4] and every multiple of 8 up to `max_size`: dense where batches are small."""
    return [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))


def capture_sizes(config: EngineConfig) -> list[int]:
    """The capture sizes of an engine: `CompilationConfig.cudagraph_capture_sizes`, or the
    default ones up to min(2 * max_num_seqs * (1 + k), 512) (or `max_cudagraph_capture_size`),
    k the speculative tokens: a full batch of decodes with drafts then still gets a graph.

    No size is above `max_num_batched_tokens`: no step has more tokens.
    """
    compilation, sched = config.compilation_config, config.scheduler_config
    budget = sched.max_num_batched_tokens
    explicit = compilation.cudagraph_capture_sizes
    if explicit is not None:
        if not isinstance(explicit, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= budget for s in explicit
        ):
            raise ValueError(
                f"cudagraph_capture_sizes must be a list of ints in [1, max_num_batched_tokens={budget}], "
                f"got {explicit!r}."
            )
        return sorted(set(explicit))
    limit = compilation.max_cudagraph_capture_size
    if limit is None:
        spec = config.speculative_config
        query_len = spec.uniform_decode_query_len if spec is not None else 1
        limit = min(2 * sched.max_num_seqs * query_len, MAX_DEFAULT_CAPTURE_SIZE)
    return default_capture_sizes(min(limit, budget))


def cuda_graphs_unavailable_reason(device: torch.device) -> str | None:
    """Why no CUDA graph can be captured on `device`, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this engine runs on {device.type}"
    return None


class LoweringRules(TypedDict):
    """The keyword arguments `resolve_explained` and `resolve_cudagraph_mode` both take, built
    once so the two calls below cannot be given different rules."""

    backend_name: str
    attention_compiled_piecewise: bool
    uniform_decode_query_len: int
    enforce_eager: bool


def resolve_engine_mode(
    config: EngineConfig, device: torch.device, attn_groups: list[list[AttentionGroup]]
) -> tuple[CUDAGraphMode, Resolution]:
    """The configured mode, lowered to what the device and the weakest attention backend allow,
    and what the backends' rules alone made of it (also on a CPU, where the device then says NONE).

    Logs the result and why: the device (no CUDA, no graphs), or `resolve_cudagraph_mode`'s
    rules, whose every change is a warning naming the backend.
    """
    compilation = config.compilation_config
    configured = compilation.cudagraph_mode
    support, backend = min_cudagraph_support(attn_groups)
    piecewise = attention_compiled_piecewise(compilation)
    spec = config.speculative_config
    rules = LoweringRules(
        backend_name=backend,
        attention_compiled_piecewise=piecewise,
        uniform_decode_query_len=spec.uniform_decode_query_len if spec is not None else 1,
        enforce_eager=compilation.enforce_eager,
    )
    resolution = resolve_explained(configured, support, **rules)
    unavailable = cuda_graphs_unavailable_reason(device)
    if unavailable is not None and not compilation.enforce_eager:
        if configured is CUDAGraphMode.NONE:
            logger.info("cudagraph_mode NONE: every step runs eagerly (%s).", unavailable)
        else:  # worded as resolve_cudagraph_mode's lowerings, so one grep finds every change of mode
            logger.info(
                "CUDAGraphMode.%s is not supported with a %s device; setting cudagraph_mode=NONE "
                "(every step runs eagerly: %s).",
                configured.name,
                device.type,
                unavailable,
            )
        return CUDAGraphMode.NONE, resolution
    mode = resolve_cudagraph_mode(configured, support, **rules)
    logger.info(
        "cudagraph_mode %s (configured %s; weakest attention support %s from %s; attention %s compiled piecewise).",
        mode.name,
        configured.name,
        support.name,
        backend,
        "is" if piecewise else "is not",
    )
    return mode, resolution


def capture_num_reqs(descriptor: BatchDescriptor, max_num_seqs: int, uniform_decode_query_len: int = 1) -> int:
    """Request rows of a FULL graph: a replayed batch is padded to this many requests (query
    length 0, sequence length 0), since the graph's metadata tensors have fixed shapes. A uniform
    decode key holds `uniform_decode_query_len` (1 + k) tokens per request."""
    if descriptor.uniform_decode:
        return descriptor.num_tokens // uniform_decode_query_len
    return min(descriptor.num_tokens, max_num_seqs)


def capture_query_lens(descriptor: BatchDescriptor, max_num_seqs: int, uniform_decode_query_len: int = 1) -> list[int]:
    """Query lengths of the dummy batch a graph is captured with: `capture_num_reqs` requests
    sharing the tokens evenly (1 + k each for a uniform decode), so that no dummy sequence is
    longer than it must be."""
    num_reqs = capture_num_reqs(descriptor, max_num_seqs, uniform_decode_query_len)
    base, extra = divmod(descriptor.num_tokens, num_reqs)
    return [base + 1] * extra + [base] * (num_reqs - extra)


class CudagraphDispatcher:
    """Which graph, if any, runs a step: keyed on the padded token count and uniform decode.

    The keys are planned from the resolved mode: mixed batches get the mode's mixed routine
    at every capture size; uniform decode batches (every request `uniform_decode_query_len`
    = 1 + k query tokens) get their own FULL graphs when the mode runs decodes FULL and mixed
    batches otherwise, at `decode_sizes`: (1 + k) x each capture size of at most `max_num_seqs`
    requests, so that a decode batch is padded with whole requests and never misses its graph
    (vLLM rounds its capture sizes to multiples of 1 + k likewise, vllm/config/compilation.py).

        k = 2:  decode_sizes [3, 6, 12, 24, ...]   a batch of 3 requests x 3 tokens -> key 12
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        sizes: Sequence[int],
        max_num_seqs: int,
        uniform_decode_query_len: int = 1,
        max_num_tokens: int | None = None,
    ) -> None:
        self.mode = mode
        self.sizes = sorted(sizes)
        self.uniform_decode_query_len = uniform_decode_query_len
        limit = max_num_tokens if max_num_tokens is not None else max(self.sizes, default=0)
        self.decode_sizes = sorted(
            {
                uniform_decode_query_len * s
                for s in self.sizes
                if s <= max_num_seqs and uniform_decode_query_len * s <= limit
            }
        )
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {CUDAGraphMode.FULL: set()}
        self.keys[CUDAGraphMode.PIECEWISE] = set()
        mixed = mode.mixed_mode()
        if mixed is not CUDAGraphMode.NONE:
            self.keys[mixed].update(BatchDescriptor(s) for s in self.sizes)
        # Mixed FULL graphs serve single-token decodes too; 1 + k-token decodes get their own graphs,
        # captured with that query length as the bound (a mixed graph must allow one long request).
        if mode.decode_mode() is CUDAGraphMode.FULL and (
            mixed is not CUDAGraphMode.FULL or uniform_decode_query_len > 1
        ):
            self.keys[CUDAGraphMode.FULL].update(BatchDescriptor(s, uniform_decode=True) for s in self.decode_sizes)

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int | None:
        """The smallest capture size (a decode size for a uniform decode) >= num_tokens, None above the largest."""
        sizes = self.decode_sizes if uniform_decode else self.sizes
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else None

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """FULL, then PIECEWISE, then NONE: the runtime mode and the key of this step's batch.

        With a graph, the key's `num_tokens` is the padded count; without one (NONE) the batch
        runs as it is and the key describes it unpadded.
        """
        candidates = []
        if uniform_decode and (padded := self.padded_num_tokens(num_tokens, uniform_decode=True)) is not None:
            candidates.append((CUDAGraphMode.FULL, BatchDescriptor(padded, uniform_decode=True)))
        if (padded := self.padded_num_tokens(num_tokens)) is not None:
            candidates += [
                (CUDAGraphMode.FULL, BatchDescriptor(padded)),
                (CUDAGraphMode.PIECEWISE, BatchDescriptor(padded)),
            ]
        for mode, key in candidates:
            if key in self.keys[mode]:
                return mode, key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, uniform_decode)

    def captures(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (runtime mode, key) to capture, largest first: smaller graphs then fit in the
        memory the larger ones left in the shared pool."""
        planned = [(mode, key) for mode, keys in self.keys.items() for key in keys]
        return sorted(planned, key=lambda item: (-item[1].num_tokens, item[0].name, item[1].uniform_decode))


# ---- graphs ---------------------------------------------------------------------------------


class Graph(Protocol):
    """One captured call: `capture` records `fn(*args)` and returns its outputs; `replay`
    reruns the recording and returns the same output tensors, now holding the new results."""

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any: ...

    def replay(self) -> Any: ...


@dataclass
class GraphMemory:
    """What all graphs of one runner share: a memory pool and a side stream to capture on."""

    pool: Any = None
    stream: torch.cuda.Stream | None = None


_capture_allowed = False


@contextlib.contextmanager
def capture_phase() -> Iterator[None]:
    """Allow captures (the runner's start-up); a capture asked for at any other time is a bug."""
    global _capture_allowed
    previous, _capture_allowed = _capture_allowed, True
    try:
        yield
    finally:
        _capture_allowed = previous


def _weak_ref(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory that does not keep it allocated.

    The memory goes back to the graph pool for later captures to reuse, while the graph
    keeps writing into it at every replay: which is why replays must follow capture order.
    """
    storage = tensor.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        weak, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


class TorchCUDAGraph:
    """A `torch.cuda.CUDAGraph` in the runner's pool, captured on the runner's side stream."""

    def __init__(self, memory: GraphMemory) -> None:
        if memory.pool is None:
            memory.pool = torch.cuda.graph_pool_handle()
            # torch.cuda.Stream.__new__ has no annotations in torch (torch/cuda/streams.py).
            memory.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.memory = memory
        self.graph = torch.cuda.CUDAGraph()
        self.output: Any = None

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        # What torch.cuda.graph does, without its empty_cache() per capture: a piecewise model
        # captures one graph per piece and size, and emptying the cache each time costs.
        torch.cuda.synchronize()
        with torch.cuda.stream(self.memory.stream):
            self.graph.capture_begin(pool=self.memory.pool)
            try:
                output = fn(*args)
            finally:
                self.graph.capture_end()
        self.output = tree_map_only(torch.Tensor, _weak_ref, output)
        # The caller gets the owning tensors: the rest of this capture forward may still use them.
        return output

    def replay(self) -> Any:
        self.graph.replay()
        return self.output


class CUDAGraphWrapper:
    """Captures `runnable` once per `BatchDescriptor`, then replays it: for FULL graphs around
    the whole model, for PIECEWISE graphs around each compiled piece.

    Called inside a forward context, it captures or replays when the context's runtime mode is
    its own, and calls `runnable` directly otherwise (eager steps, the profile run, a piece
    inside a FULL capture). It never copies inputs: the caller passes the same persistent
    tensors (same addresses) at capture and at every replay.
    """

    def __init__(
        self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode, memory: GraphMemory, name: str
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"A graph wrapper runs FULL or PIECEWISE graphs, not {runtime_mode.name}.")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.memory = memory
        self.name = name
        self.graphs: dict[BatchDescriptor, Graph] = {}

    def __call__(self, *args: Any) -> Any:
        context = get_forward_context()
        if context.cudagraph_runtime_mode is not self.runtime_mode:
            return self.runnable(*args)
        descriptor = context.batch_descriptor
        if descriptor is None:
            raise RuntimeError(f"{self.name}: runtime mode {self.runtime_mode.name} without a batch descriptor.")
        graph = self.graphs.get(descriptor)
        if graph is not None:
            return graph.replay()
        if not _capture_allowed:
            raise RuntimeError(
                f"{self.name}: no {self.runtime_mode.name} graph for {descriptor}; graphs are captured at "
                "start-up only (ModelRunner.capture_model), and the dispatcher only picks captured ones."
            )
        graph = TorchCUDAGraph(self.memory)
        output = graph.capture(self.runnable, args)
        self.graphs[descriptor] = graph
        return output

    def replay(self, descriptor: BatchDescriptor) -> Any:
        """Replay the graph of `descriptor` directly: no forward context is read or needed."""
        return self.graphs[descriptor].replay()


def piece_wrapper(memory: GraphMemory) -> PieceWrapper:
    """The `wrap_piece` hook of `compile_model`: a PIECEWISE graph wrapper per compiled piece."""

    def wrap(piece: CompiledPiece) -> CUDAGraphWrapper:
        return CUDAGraphWrapper(piece.runnable, CUDAGraphMode.PIECEWISE, memory, f"piece {piece.index} ({piece.name})")

    return wrap
