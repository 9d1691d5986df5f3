"""The model runner: owns the model and the KV cache, and runs one step.

Start-up:  build model (layers register by name) -> profile run (no metadata) ->
           size the KV cache -> attention groups with their builders and kernel block
           sizes -> one buffer per KV cache group, a view per layer in kernel blocks,
           bound by name -> `capture_model`: resolve the CUDA graph mode, capture graphs.
Each step: dispatch (FULL / PIECEWISE / NONE, padded size) -> InputBatch ->
           CommonAttentionMetadata per KV cache group -> build per attention group ->
           FULL: replay the whole model's graph (no forward context);
           else set_forward_context(...) around model(...) -> logits.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.layer import Attention
from pagedkv.config import CUDAGraphMode
from pagedkv.compilation.wrapper import CompiledForward, compile_model
from pagedkv.config import EngineConfig, set_current_engine_config
from pagedkv.forward_context import BatchDescriptor, get_layers_from_config, set_forward_context
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, get_kv_cache_config
from pagedkv.models.loader import CausalLM, HFConfig, load_model, weight_bytes
from pagedkv.worker import cudagraph
from pagedkv.worker.attn_utils import AttentionGroup, build_attn_metadata, init_attn_groups
from pagedkv.worker.input_batch import (
    PLACEHOLDER_TOKEN_ID,
    BlockTable,
    InputBatch,
    SampledTokens,
    ScheduledTokens,
    compute_slot_mapping,
)

logger = logging.getLogger("pagedkv")

CPU_DEFAULT_KV_CACHE_BYTES = 64 * 2**20


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`: the GPU's free memory plus what torch's
    caching allocator holds unused; on the CPU Linux's MemAvailable; None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    return None if kib is None else int(kib) * 1024


def check_fits(what: str, nbytes: int, device: torch.device, hint: str) -> None:
    """Refuse, before allocating, `nbytes` that `device` does not have (the allocator's own error is
    a page long, and Linux may grant a CPU allocation that it later kills the process for touching)."""
    available = available_memory(device)
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB on {device}, but only {available / 2**30:.2f} GiB "
                         f"is available: {hint}")


@dataclass
class StepResult:
    """What one `execute_model` produced, kept for step listeners."""

    batch: InputBatch
    attn_metadata: dict[str, Any]
    slot_mapping: dict[str, torch.Tensor]
    batch_descriptor: BatchDescriptor
    logits: torch.Tensor
    """[num sampling requests, vocab]"""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    """How the step ran: FULL (one graph replayed), PIECEWISE or NONE (eager)."""


class ModelRunner:
    """Model + KV cache + per-step inputs on one device."""

    def __init__(self, config: EngineConfig, model_config: HFConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        with set_current_engine_config(config):
            nbytes, num_params = weight_bytes(model_config)
            check_fits(
                f"Model {config.model_config.model!r} ({num_params / 1e9:.2f}B parameters, float32 while loading)",
                nbytes, self.device,
                "use a smaller model" + (", or a GPU." if self.device.type == "cpu" else " or a bigger GPU."),
            )
            self.model: CausalLM = load_model(
                config.model_config.model, model_config, config.model_config.dtype, self.device,
                config.model_config.seed,
            )
        self.graph_memory = cudagraph.GraphMemory()
        self.compiled_forward: CompiledForward | None = None
        """With `compilation_config.compile`: `self.model(...)` runs this piecewise-compiled forward."""
        if config.compilation_config.compile:
            # Where graphs can exist, every piece gets a wrapper; it only captures or replays in
            # steps the dispatcher sends to PIECEWISE, and passes through otherwise.
            graphs_possible = cudagraph.cuda_graphs_unavailable_reason(self.device) is None
            wrap = cudagraph.piece_wrapper(self.graph_memory) if graphs_possible else None
            self.compiled_forward = compile_model(self.model, config, wrap_piece=wrap)
        self.cudagraph_mode = CUDAGraphMode.NONE
        """The resolved mode (`capture_model`); until then every step runs eagerly."""
        self.dispatcher: cudagraph.CudagraphDispatcher | None = None
        self.full_graph: cudagraph.CUDAGraphWrapper | None = None
        """The FULL graphs, one per batch descriptor, around the whole model."""
        self.buffers: cudagraph.InputBuffers | None = None
        """Persistent step inputs, once graphs are captured (eager steps use fresh tensors, so a
        recorded step keeps its own values)."""
        self.attn_layers: dict[str, Attention] = get_layers_from_config(config, Attention)
        self.kv_cache_config: KVCacheConfig
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.attn_groups: list[list[AttentionGroup]] = []
        self.layer_kv_group: dict[str, int] = {}
        """Layer name -> its KV cache group: whose slot mapping the layer reads each step."""
        self.block_tables: list[BlockTable] = []

    # ---- start-up -------------------------------------------------------------------

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, for layers that own a cache (KV-sharing layers do not)."""
        specs = {name: layer.get_kv_cache_spec() for name, layer in self.attn_layers.items()}
        return {name: spec for name, spec in specs.items() if spec is not None}

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest batch without metadata (attention outputs zeros), so that its
        activations are counted before the KV cache takes what memory is left."""
        n = self.config.scheduler_config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.config.model_config.max_model_len
        with set_forward_context(None, self.config):
            hidden = self.model(ids, positions)
        self.model.compute_logits(hidden[-self.config.scheduler_config.max_num_seqs:])

    def determine_kv_cache_config(self) -> KVCacheConfig:
        specs = self.get_kv_cache_specs()
        cache = self.config.cache_config
        if cache.num_kv_blocks is not None:
            return get_kv_cache_config(specs, num_blocks=cache.num_kv_blocks)
        self.profile_run()
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            # What is still free after the weights and the profile run's activations, minus the
            # share of the GPU the engine must leave alone (other engines in this process count too).
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1.0 - cache.memory_utilization) * total)
        else:
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        config = get_kv_cache_config(specs, memory_bytes=max(budget, 0))
        if cache.kv_cache_memory is None:
            # Never more than a full batch of max-length requests can use.
            sched = self.config.scheduler_config
            needed = sched.max_num_seqs * math.ceil(self.config.model_config.max_model_len / self.block_size) + 1
            config.num_blocks = min(config.num_blocks, needed)
        return config

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Attention groups first (they choose the kernel block size), then one zeroed backing
        buffer per KV cache group, a view per layer in kernel blocks, bound by name."""
        self.kv_cache_config = kv_cache_config
        self.attn_groups = init_attn_groups(self.attn_layers, kv_cache_config, self.config, self.device)
        for group_spec, groups in zip(kv_cache_config.kv_cache_groups, self.attn_groups):
            self.kv_caches.update(self._allocate_kv_cache_group(group_spec, groups[0].kernel_block_size))
        for name, layer in self.attn_layers.items():
            target = layer.kv_sharing_target_layer_name
            layer.bind_kv_cache(self.kv_caches[target if target is not None else name])
        self.layer_kv_group = {
            name: group.kv_cache_group_id for groups in self.attn_groups for group in groups for name in group.layer_names
        }
        max_blocks = math.ceil(self.config.model_config.max_model_len / self.block_size)
        max_reqs = self.config.scheduler_config.max_num_seqs
        self.block_tables = [
            BlockTable(max_reqs, max_blocks, g.kv_cache_spec.block_size, self.device)
            for g in kv_cache_config.kv_cache_groups
        ]
        for group in (g for groups in self.attn_groups for g in groups):
            k = group.kv_cache_spec.block_size // group.kernel_block_size
            if k > 1:
                group.kernel_block_table = torch.zeros(max_reqs, max_blocks * k, dtype=torch.int32, device=self.device)

    def _allocate_kv_cache_group(self, group_spec: KVCacheGroupSpec, kernel_block_size: int) -> dict[str, torch.Tensor]:
        """One zeroed buffer for the group; each layer's slice viewed as pages of the kernel's size.

        The manager's `num_blocks` blocks of B tokens are `num_blocks * k` kernel blocks of B/k
        tokens (k = B / kernel_block_size): the same bytes, cut finer. Manager block b is kernel
        blocks b*k ... b*k + k-1, which is how the attention groups rewrite the block table.
        """
        spec = group_spec.kv_cache_spec
        k = spec.block_size // kernel_block_size
        shapes = [
            self.attn_layers[name].attn_backend.get_kv_cache_shape(
                self.kv_cache_config.num_blocks * k, kernel_block_size, spec.num_kv_heads, spec.head_size
            )
            for name in group_spec.layer_names
        ]
        per_layer = math.prod(shapes[0])
        cache = self.config.cache_config
        check_fits(
            f"The KV cache ({self.kv_cache_config.num_blocks} blocks of {spec.block_size} tokens for {len(shapes)} "
            "layers)", per_layer * len(shapes) * spec.dtype.itemsize, self.device,
            f"it was sized by num_kv_blocks={cache.num_kv_blocks}, kv_cache_memory={cache.kv_cache_memory}; lower "
            "them, or leave both None to size it from free memory.",
        )
        buffer = torch.zeros(per_layer * len(shapes), dtype=spec.dtype, device=self.device)
        return {
            name: buffer[i * per_layer : (i + 1) * per_layer].view(shape)
            for i, (name, shape) in enumerate(zip(group_spec.layer_names, shapes))
        }

    # ---- CUDA graphs ----------------------------------------------------------------

    @torch.inference_mode()
    def capture_model(self) -> CUDAGraphMode:
        """Resolve the CUDA graph mode and capture every graph the dispatcher may pick.

        Called once, after `initialize_kv_cache` (graphs read the bound KV cache). Each key is
        first run eagerly with the capture's own metadata, so that every kernel (Triton,
        Inductor, flash-attn 4's JIT) is compiled and loaded outside the capture.
        """
        self.cudagraph_mode = mode = cudagraph.resolve_engine_mode(self.config, self.device, self.attn_groups)
        if mode is CUDAGraphMode.NONE:
            self._log_startup("no CUDA graphs")
            return mode
        sched = self.config.scheduler_config
        dispatcher = cudagraph.CudagraphDispatcher(mode, cudagraph.capture_sizes(self.config), sched.max_num_seqs)
        self.buffers = cudagraph.InputBuffers(
            sched.max_num_batched_tokens, sched.max_num_seqs, len(self.block_tables), self.device
        )
        if mode.has_full_cudagraphs():
            self.full_graph = cudagraph.CUDAGraphWrapper(self.model, CUDAGraphMode.FULL, self.graph_memory, "model")
        captures = dispatcher.captures()
        start = time.perf_counter()
        with cudagraph.capture_phase():
            for runtime_mode, descriptor in captures:
                self._capture(runtime_mode, descriptor)
        self.dispatcher = dispatcher
        elapsed = time.perf_counter() - start
        self._log_startup(f"{len(captures)} CUDA graph keys ({mode.name}) captured in {elapsed:.1f} s")
        return mode

    def _log_startup(self, graphs: str) -> None:
        """One line on what start-up spent on torch.compile (and whether its cache was warm) and on graphs."""
        compiled = self.compiled_forward
        if compiled is None:
            compile_part = "not compiled"
        elif compiled.traced:
            compile_part = f"torch.compile {compiled.compile_seconds:.1f} s, {compiled.cache.describe()}"
        else:  # no profile run (num_kv_blocks given) and no capture: the first step of >= 2 tokens traces
            compile_part = "torch.compile at the first step of 2 tokens or more"
        logger.info("Start-up: %s; %s.", compile_part, graphs)

    def _capture(self, runtime_mode: CUDAGraphMode, descriptor: BatchDescriptor) -> None:
        """Warm up, then capture, the graphs of one key, on a dummy batch of its shape.

        The dummy batch writes nothing to the cache (slots -1) and reads only the null block.
        A FULL graph keeps the capture metadata (`build_for_cudagraph_capture`: host-side
        bounds valid for every batch it will replay); PIECEWISE graphs leave attention out.
        """
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        query_lens = cudagraph.capture_query_lens(descriptor, max_num_seqs)
        positions = [p for n in query_lens for p in range(n)]
        batch = self._stage_batch(
            [f"<capture {i}>" for i in range(len(query_lens))], [0] * len(positions), positions, query_lens,
            seq_lens=query_lens, block_rows=[[[]] * len(query_lens) for _ in self.block_tables], logits_indices=[],
            sampling_req_ids=[], num_padded_tokens=descriptor.num_tokens, write_cache=False,
        )
        full = runtime_mode is CUDAGraphMode.FULL
        metadata, slot_mapping = self._build_metadata(batch, descriptor.num_tokens, for_cudagraph_capture=full)
        for step_mode in (CUDAGraphMode.NONE, runtime_mode):
            with set_forward_context(
                metadata, self.config, slot_mapping=slot_mapping, cudagraph_runtime_mode=step_mode,
                batch_descriptor=descriptor,
            ):
                self._forward(batch.input_ids, batch.positions)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model, through the FULL graph wrapper when there is one (it obeys the context)."""
        return (self.full_graph or self.model)(input_ids, positions)

    # ---- one step -------------------------------------------------------------------

    def prepare_inputs(
        self,
        scheduled: list[ScheduledTokens],
        block_ids: dict[str, list[list[int]]],
        num_padded_tokens: int | None = None,
        num_padded_reqs: int | None = None,
        previous: SampledTokens | None = None,
    ) -> InputBatch:
        """Pack the scheduled tokens of all requests into flat tensors (see input_batch.py),
        padded to `num_padded_tokens` tokens and `num_padded_reqs` requests for a graph.
        Placeholder tokens take their ids from `previous` (the last step's samples) on the device."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_req_ids: list[str] = []
        for s in scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            token_ids += s.token_ids
            positions += range(start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(len(token_ids) - 1)
                sampling_req_ids.append(s.req_id)
        req_ids = [s.req_id for s in scheduled]
        block_rows = [[block_ids[r][g] for r in req_ids] for g in range(len(self.block_tables))]
        batch = self._stage_batch(
            req_ids, token_ids, positions, query_lens, seq_lens, block_rows, logits_indices, sampling_req_ids,
            num_padded_tokens=num_padded_tokens, num_padded_reqs=num_padded_reqs,
        )
        placeholders = [(i, s.req_id) for s, i in zip(scheduled, itertools.accumulate(len(s.token_ids) for s in scheduled))
                        if s.token_ids[-1] == PLACEHOLDER_TOKEN_ID]
        if placeholders:
            self._fill_placeholders(batch.input_ids, placeholders, previous)
        return batch

    def _fill_placeholders(self, input_ids: torch.Tensor, placeholders: list[tuple[int, str]],
                           previous: SampledTokens | None) -> None:
        """Copy the ids the previous step sampled into the placeholders (each a request's last
        token, at packed index end - 1), device to device: the host never waits for them."""
        if previous is None:
            raise ValueError(f"{len(placeholders)} scheduled token(s) are placeholders, but no previous step's "
                             "samples were given (execute_model's `previous`).")
        row = {req_id: i for i, req_id in enumerate(previous.req_ids)}
        missing = [r for _, r in placeholders if r not in row]
        if missing:
            raise ValueError(f"Requests {missing} have a placeholder token, but the previous step sampled none for them.")
        index = torch.tensor([end - 1 for end, _ in placeholders], dtype=torch.long)
        rows = torch.tensor([row[r] for _, r in placeholders], dtype=torch.long)
        input_ids[index.to(self.device, non_blocking=True)] = previous.token_ids[rows.to(self.device, non_blocking=True)]

    def _stage_batch(
        self,
        req_ids: list[str],
        token_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_rows: list[list[list[int]]],
        logits_indices: list[int],
        sampling_req_ids: list[str],
        *,
        num_padded_tokens: int | None = None,
        num_padded_reqs: int | None = None,
        write_cache: bool = True,
    ) -> InputBatch:
        """Host lists -> the step's device tensors. Padding tokens are id 0 at position 0 with
        slot -1; padding requests have no query tokens and sequence length 0."""
        num_tokens, num_reqs = len(token_ids), len(query_lens)
        pad_tokens = (num_padded_tokens or num_tokens) - num_tokens
        pad_reqs = (num_padded_reqs or num_reqs) - num_reqs
        buffers = self.buffers
        positions_cpu = torch.tensor(positions, dtype=torch.long)
        req_indices = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(query_lens))
        slot_mappings = []
        for g, table in enumerate(self.block_tables):
            table.set_rows(block_rows[g] + [[]] * pad_reqs)
            if write_cache:
                slots = compute_slot_mapping(table.get_cpu_tensor(), req_indices, positions_cpu, table.block_size,
                                             num_tokens + pad_tokens)
            else:
                slots = torch.full((num_tokens + pad_tokens,), -1, dtype=torch.long)
            slot_mappings.append(self._to_device(slots, buffers and buffers.slot_mappings[g]))
        starts = list(itertools.accumulate(query_lens, initial=0))
        qsl_cpu = torch.tensor(starts + [num_tokens] * pad_reqs, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
        padding = [0] * pad_tokens
        ids_cpu, positions_padded = (torch.tensor(x + padding, dtype=torch.long) for x in (token_ids, positions))
        return InputBatch(
            req_ids=req_ids,
            input_ids=self._to_device(ids_cpu, buffers and buffers.input_ids),
            positions=self._to_device(positions_padded, buffers and buffers.positions),
            query_start_loc=self._to_device(qsl_cpu, buffers and buffers.query_start_loc),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self._to_device(seq_lens_cpu, buffers and buffers.seq_lens),
            seq_lens_cpu=seq_lens_cpu,
            num_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_tables=[t.get_device_tensor() for t in self.block_tables],
            slot_mappings=slot_mappings,
            logits_indices=self._to_device(torch.tensor(logits_indices, dtype=torch.long), None),
            sampling_req_ids=sampling_req_ids,
        )

    def _to_device(self, values: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
        """Into the first rows of a persistent buffer, or a fresh device tensor without one."""
        if buffer is None:
            return values.to(self.device, non_blocking=True)
        return cudagraph.stage(buffer, values)

    def common_attn_metadata(
        self, batch: InputBatch, kv_group: int, num_actual_tokens: int | None = None
    ) -> CommonAttentionMetadata:
        """The batch as attention sees it in one KV cache group. Its request rows are the
        tensors' rows (padding requests included); `num_actual_tokens` defaults to the batch's
        real tokens (a FULL graph's metadata counts the padded ones)."""
        return CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            num_reqs=batch.seq_lens.shape[0],
            num_actual_tokens=batch.num_tokens if num_actual_tokens is None else num_actual_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            block_table_tensor=batch.block_tables[kv_group],
            slot_mapping=batch.slot_mappings[kv_group],
        )

    def _build_metadata(
        self, batch: InputBatch, num_actual_tokens: int, for_cudagraph_capture: bool = False
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Layer name -> attention metadata, and layer name -> slot mapping, for one step."""
        commons = [self.common_attn_metadata(batch, g, num_actual_tokens) for g in range(len(self.block_tables))]
        attn_metadata = build_attn_metadata(self.attn_groups, commons, for_cudagraph_capture)
        slot_mapping = {name: batch.slot_mappings[g] for name, g in self.layer_kv_group.items()}
        return attn_metadata, slot_mapping

    @torch.inference_mode()
    def execute_model(self, scheduled: list[ScheduledTokens], block_ids: dict[str, list[list[int]]],
                      previous: SampledTokens | None = None) -> StepResult:
        """Run the model on the scheduled tokens; return logits of the requests that sample.
        Placeholder tokens (async scheduling) take their ids from `previous`, on the device."""
        num_tokens = sum(len(s.token_ids) for s in scheduled)
        uniform_decode = max(len(s.token_ids) for s in scheduled) == 1
        mode, descriptor = CUDAGraphMode.NONE, BatchDescriptor(num_tokens, uniform_decode)
        if self.dispatcher is not None:
            mode, descriptor = self.dispatcher.dispatch(num_tokens, uniform_decode)
        full = mode is CUDAGraphMode.FULL
        num_reqs = cudagraph.capture_num_reqs(descriptor, self.config.scheduler_config.max_num_seqs) if full else None
        batch = self.prepare_inputs(scheduled, block_ids, descriptor.num_tokens, num_reqs, previous)
        # Built in FULL steps too: builders rewrite their persistent buffers (graphs read those).
        attn_metadata, slot_mapping = self._build_metadata(batch, descriptor.num_tokens if full else num_tokens)
        if full:
            assert self.full_graph is not None
            # The inputs are in the buffers the graph reads: no model code runs, so nothing
            # looks anything up, and no forward context is set (seed 000, step 7).
            hidden = self.full_graph.replay(descriptor)
        else:
            with set_forward_context(
                attn_metadata, self.config, slot_mapping=slot_mapping, cudagraph_runtime_mode=mode,
                batch_descriptor=descriptor,
            ):
                hidden = self._forward(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return StepResult(batch, attn_metadata, slot_mapping, descriptor, logits, mode)
