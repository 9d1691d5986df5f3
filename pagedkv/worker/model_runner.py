"""The model runner: owns the model and the KV cache, and runs one step.

Start-up:  build model (layers register by name) -> profile run (no metadata) ->
           size the KV cache -> attention groups with their builders and kernel block
           sizes -> one buffer per KV cache group, a view per layer in kernel blocks,
           bound by name.
Each step: InputBatch -> CommonAttentionMetadata per KV cache group -> build per
           attention group -> set_forward_context(...) around model(...) -> logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.layer import Attention
from pagedkv.compilation.wrapper import CompiledForward, compile_model
from pagedkv.config import EngineConfig, set_current_engine_config
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.forward_context import BatchDescriptor, set_forward_context
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, get_kv_cache_config
from pagedkv.models.llama import LlamaConfig, LlamaForCausalLM
from pagedkv.models.loader import load_model
from pagedkv.worker.attn_utils import AttentionGroup, build_attn_metadata, init_attn_groups
from pagedkv.worker.input_batch import BlockTable, InputBatch, compute_slot_mapping

CPU_DEFAULT_KV_CACHE_BYTES = 64 * 2**20


@dataclass
class StepResult:
    """What one `execute_model` produced, kept for step listeners."""

    batch: InputBatch
    attn_metadata: dict[str, Any]
    slot_mapping: dict[str, torch.Tensor]
    batch_descriptor: BatchDescriptor
    logits: torch.Tensor
    """[num sampling requests, vocab]"""


class ModelRunner:
    """Model + KV cache + per-step inputs on one device."""

    def __init__(self, config: EngineConfig, model_config: LlamaConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        with set_current_engine_config(config):
            self.model: LlamaForCausalLM = load_model(
                config.model_config.model, model_config, config.model_config.dtype, self.device,
                config.model_config.seed,
            )
        self.compiled_forward: CompiledForward | None = None
        """With `compilation_config.compile`: `self.model(...)` runs this piecewise-compiled forward."""
        if config.compilation_config.compile:
            self.compiled_forward = compile_model(self.model, config)
        static = config.compilation_config.static_forward_context
        self.attn_layers: dict[str, Attention] = {n: m for n, m in static.items() if isinstance(m, Attention)}
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
        self.block_tables = [
            BlockTable(self.config.scheduler_config.max_num_seqs, max_blocks, g.kv_cache_spec.block_size, self.device)
            for g in kv_cache_config.kv_cache_groups
        ]

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
        buffer = torch.zeros(per_layer * len(shapes), dtype=spec.dtype, device=self.device)
        return {
            name: buffer[i * per_layer : (i + 1) * per_layer].view(shape)
            for i, (name, shape) in enumerate(zip(group_spec.layer_names, shapes))
        }

    # ---- one step -------------------------------------------------------------------

    def prepare_inputs(self, sched: SchedulerOutput, block_ids: dict[str, list[list[int]]]) -> InputBatch:
        """Pack the scheduled tokens of all requests into flat tensors (see input_batch.py)."""
        token_ids: list[int] = []
        positions: list[int] = []
        req_indices: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_req_ids: list[str] = []
        for i, s in enumerate(sched.scheduled):
            req = s.request
            start = s.num_computed_tokens
            end = start + s.num_new_tokens
            token_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            req_indices += [i] * s.num_new_tokens
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(query_start_loc[-1] - 1)
                sampling_req_ids.append(req.request_id)
        req_ids = [s.request.request_id for s in sched.scheduled]
        to_dev = lambda x: x.to(self.device, non_blocking=True)  # noqa: E731
        positions_cpu = torch.tensor(positions, dtype=torch.long)
        req_indices_cpu = torch.tensor(req_indices, dtype=torch.long)
        slot_mappings = []
        for g, table in enumerate(self.block_tables):
            table.set_rows([block_ids[r][g] for r in req_ids])
            slot_mappings.append(to_dev(compute_slot_mapping(table.get_cpu_tensor(), req_indices_cpu, positions_cpu, table.block_size)))
        qsl_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        return InputBatch(
            req_ids=req_ids,
            input_ids=to_dev(torch.tensor(token_ids, dtype=torch.long)),
            positions=to_dev(positions_cpu),
            query_start_loc=to_dev(qsl_cpu),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=to_dev(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            num_tokens=len(token_ids),
            max_query_len=max(s.num_new_tokens for s in sched.scheduled),
            max_seq_len=max(seq_lens),
            block_tables=[t.get_device_tensor() for t in self.block_tables],
            slot_mappings=slot_mappings,
            logits_indices=to_dev(torch.tensor(logits_indices, dtype=torch.long)),
            sampling_req_ids=sampling_req_ids,
        )

    def common_attn_metadata(self, batch: InputBatch, kv_group: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            num_reqs=batch.num_reqs,
            num_actual_tokens=batch.num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            block_table_tensor=batch.block_tables[kv_group],
            slot_mapping=batch.slot_mappings[kv_group],
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, block_ids: dict[str, list[list[int]]]) -> StepResult:
        """Run the model on the scheduled tokens; return logits of the requests that sample."""
        batch = self.prepare_inputs(sched, block_ids)
        commons = [self.common_attn_metadata(batch, g) for g in range(len(self.block_tables))]
        attn_metadata = build_attn_metadata(self.attn_groups, commons)
        slot_mapping = {name: batch.slot_mappings[g] for name, g in self.layer_kv_group.items()}
        descriptor = BatchDescriptor(num_tokens=batch.num_tokens, uniform_decode=batch.max_query_len == 1)
        with set_forward_context(attn_metadata, self.config, slot_mapping=slot_mapping, batch_descriptor=descriptor):
            hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return StepResult(batch, attn_metadata, slot_mapping, descriptor, logits)
