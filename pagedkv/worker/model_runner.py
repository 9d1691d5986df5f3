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

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.attention.backend import CommonAttentionMetadata
from pagedkv.attention.layer import Attention
from pagedkv.compilation.resolve import Resolution
from pagedkv.compilation.wrapper import CompiledForward, compile_model
from pagedkv.config import CUDAGraphMode, EngineConfig, set_current_engine_config
from pagedkv.forward_context import BatchDescriptor, get_layers_from_config, set_forward_context
from pagedkv.interrupts import deferred_interrupts
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheSpec
from pagedkv.models.loader import CausalLM, HFConfig, load_model, weight_bytes
from pagedkv.ranges import phase_range
from pagedkv.worker import cudagraph
from pagedkv.worker.attn_utils import (
    AttentionGroup,
    build_attn_metadata,
    check_batch_invariance,
    init_attn_groups,
    init_kv_cache,
    kv_group_causal,
    layer_kv_groups,
    max_blocks_per_request,
)
from pagedkv.worker.draft_model import DRAFT_PREFIX, DraftModelProposer
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, InputBatch, SampledTokens, ScheduledTokens
from pagedkv.worker.memory import check_fits, kv_cache_config_for
from pagedkv.worker.prepare_inputs import StepBuffers, StepSchedule, prepare_inputs
from pagedkv.worker.sampling_metadata import SamplingMetadata
from pagedkv.worker.states import RequestStates, to_device

logger = logging.getLogger("pagedkv")


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
    draft_token_ids: torch.Tensor | None = None
    """Speculative decoding: the drafts verified, packed request after request (on the device)."""
    sampling_metadata: SamplingMetadata | None = None
    """Per logits row, its request's sampling parameters and the position it draws, gathered from the
    request rows (`execute_model` always sets it)."""
    prompt_logits: torch.Tensor | None = None
    """[tokens, vocab]: the logits at the prompt positions asked for (`ScheduledTokens.num_prompt_logits`),
    request after request in batch order; None when no request asked."""


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
                nbytes,
                self.device,
                "use a smaller model" + (", or a GPU." if self.device.type == "cpu" else " or a bigger GPU."),
            )
            self.model: CausalLM = load_model(
                config.model_config.model,
                model_config,
                config.model_config.dtype,
                self.device,
                config.model_config.seed,
            )
            self.drafter: DraftModelProposer | None = DraftModelProposer.load(config)
            """With a draft model (speculative decoding): proposes each step's drafts; runs eagerly."""
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
        self.cudagraph_resolution: Resolution | None = None
        """What the lowering rules made of the configured mode for these attention groups and decode
        query length (`capture_model`; computed on a CPU too, where the device then rules out graphs)."""
        spec = config.speculative_config
        self.uniform_decode_query_len = spec.uniform_decode_query_len if spec is not None else 1
        """Query tokens of each request in a uniform decode step: 1 + speculative tokens."""
        self.dispatcher: cudagraph.CudagraphDispatcher | None = None
        self.full_graph: cudagraph.CUDAGraphWrapper | None = None
        """The FULL graphs, one per batch descriptor, around the whole model."""
        self.attn_layers: dict[str, Attention] = get_layers_from_config(config, Attention)
        if config.model_config.batch_invariant:
            check_batch_invariance(self.attn_layers)
        self.kv_cache_config: KVCacheConfig
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.attn_groups: list[list[AttentionGroup]] = []
        self.draft_attn_groups: list[list[AttentionGroup]] = []
        """Per KV cache group, the attention groups holding draft model layers (speculative decoding)."""
        self.layer_kv_group: dict[str, int] = {}
        """Layer name -> its KV cache group: whose slot mapping the layer reads each step."""
        self.kv_group_causal: list[bool] = []
        """Per KV cache group, whether its layers attend causally (`CommonAttentionMetadata.causal`)."""
        self.block_sizes: list[int] = []
        """Per KV cache group, its block size (slot = block * block_size + offset)."""
        self.states: RequestStates
        """Every running request's row: tokens, block tables, sampling parameters (pagedkv/worker/states.py)."""
        self.buffers: StepBuffers | None = None
        """The step inputs' persistent tensors, once graphs are captured (they read them there); eager
        steps get fresh tensors, so a recorded step (a kept ForwardContext) keeps its own values."""

    # ---- start-up -------------------------------------------------------------------

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, for layers that own a cache (KV-sharing layers do not)."""
        specs = {name: layer.get_kv_cache_spec() for name, layer in self.attn_layers.items()}
        return {name: spec for name, spec in specs.items() if spec is not None}

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest batch without metadata (attention outputs zeros), so that its
        activations are counted before the KV cache takes what memory is left; a draft model runs
        it too, as it does every step. With an fp8 KV cache and `calculate_kv_scales` its K and V also
        set the scales of each layer not given any (`Attention.calc_kv_scales`), the draft model's
        included: so the tokens are every id in turn, not one id repeated."""
        n = self.config.scheduler_config.max_num_batched_tokens
        ids = torch.arange(n, device=self.device) % self.model.config.vocab_size
        positions = torch.arange(n, device=self.device) % self.config.model_config.max_model_len
        with set_forward_context(None, self.config):
            hidden = self.model(ids, positions)
            if self.drafter is not None:
                self.drafter.model(ids, positions)
        self.model.compute_logits(hidden[-self.config.scheduler_config.max_num_seqs :])

    def determine_kv_cache_config(self) -> KVCacheConfig:
        """The KV cache's blocks: given, or what memory is left after a profile run (worker/memory.py)."""
        kv_cache_config = kv_cache_config_for(
            self.config, self.get_kv_cache_specs(), self.device, self.profile_run, max_blocks_per_request(self.config)
        )
        if any(layer.calculate_kv_scales for layer in self.attn_layers.values()):
            self.profile_run()  # calculate_kv_scales' run, where num_kv_blocks skipped the sizing's profile run
        return kv_cache_config

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Attention groups first (they choose the kernel block size), then the KV cache, allocated
        and bound by name (attn_utils.py), then one block table per KV cache group.

        Everything is built in locals and assigned to the runner at the end, and the group check
        (`kv_group_causal`, which may raise) runs before anything is allocated: a failure (or a
        KeyboardInterrupt) leaves the runner as it was."""
        attn_groups = init_attn_groups(self.attn_layers, kv_cache_config, self.config, self.device)
        group_causal = kv_group_causal(attn_groups, self.attn_layers)
        kv_caches = init_kv_cache(self.attn_layers, kv_cache_config, attn_groups, self.config.cache_config, self.device)
        sched = self.config.scheduler_config
        widths = [max_blocks_per_request(self.config)] * len(kv_cache_config.kv_cache_groups)
        states = RequestStates(sched.max_num_seqs, self.config.model_config.max_model_len, widths, self.device)
        self.kv_cache_config = kv_cache_config
        self.attn_groups = attn_groups
        # The draft model's proposal forwards build only its own groups' metadata.
        self.draft_attn_groups = [
            [g for g in groups if any(name.startswith(DRAFT_PREFIX) for name in g.layer_names)]
            for groups in attn_groups
        ]
        self.kv_caches = kv_caches
        self.layer_kv_group = layer_kv_groups(attn_groups)
        self.kv_group_causal = group_causal
        self.block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.states = states

    # ---- CUDA graphs ----------------------------------------------------------------

    @torch.inference_mode()
    def capture_model(self) -> CUDAGraphMode:
        """Resolve the CUDA graph mode and capture every graph the dispatcher may pick.

        Called once, after `initialize_kv_cache` (graphs read the bound KV cache). Each key is
        first run eagerly with the capture's own metadata, so that every kernel (Triton,
        Inductor, flash-attn 4's JIT) is compiled and loaded outside the capture.
        """
        mode, self.cudagraph_resolution = cudagraph.resolve_engine_mode(self.config, self.device, self.attn_groups)
        self.cudagraph_mode = mode
        if mode is CUDAGraphMode.NONE:
            self._log_startup("no CUDA graphs")
            return mode
        sched = self.config.scheduler_config
        dispatcher = cudagraph.CudagraphDispatcher(
            mode,
            cudagraph.capture_sizes(self.config),
            sched.max_num_seqs,
            self.uniform_decode_query_len,
            sched.max_num_batched_tokens,
        )
        widths = [table.shape[1] for table in self.states.block_tables]
        self.buffers = StepBuffers.allocate(sched.max_num_batched_tokens, sched.max_num_seqs, widths, self.device)
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
            assert compiled.cache is not None  # the trace reported on its cache
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
        query_lens = cudagraph.capture_query_lens(descriptor, max_num_seqs, self.uniform_decode_query_len)
        schedule = StepSchedule.for_capture(query_lens, self.states.padding_row)
        assert self.buffers is not None
        batch = prepare_inputs(self.states, schedule, self.buffers, self.block_sizes, descriptor.num_tokens)
        full = runtime_mode is CUDAGraphMode.FULL
        metadata, slot_mapping = self._build_metadata(
            batch, descriptor.num_tokens, for_cudagraph_capture=full, uniform_decode=descriptor.uniform_decode
        )
        for step_mode in (CUDAGraphMode.NONE, runtime_mode):
            with set_forward_context(
                metadata,
                self.config,
                slot_mapping=slot_mapping,
                cudagraph_runtime_mode=step_mode,
                batch_descriptor=descriptor,
            ):
                self._forward(batch.input_ids, batch.positions)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model, through the FULL graph wrapper when there is one (it obeys the context)."""
        hidden_states: torch.Tensor = (self.full_graph or self.model)(input_ids, positions)
        return hidden_states

    # ---- one step -------------------------------------------------------------------

    def update_states(
        self,
        scheduled: list[ScheduledTokens],
        previous: SampledTokens | None = None,
        freed_req_ids: list[str] | tuple[str, ...] = (),
    ) -> StepSchedule:
        """Bring the request rows up to date and return the step's schedule.

        Rows of `freed_req_ids` (finished, aborted, preempted) are given back first; a request seen
        for the first time gets a row. The tokens the host knows are staged (prompt chunks, and
        whatever the host sends for decodes), block ids only where they changed; placeholder tokens
        (async scheduling) are scattered from `previous` (the last step's samples) on the device.
        All or nothing: a failure gives back the rows it added and drops what it staged."""
        states, num_groups = self.states, len(self.block_sizes)
        row_of, width = states.row_of, states.token_ids.shape[1]
        stage_tokens, stage_blocks = states.token_writes.stage, states.stage_blocks
        rows: list[int] = []
        waiting: list[tuple[int, int, str]] = []  # (row, position, request) of each placeholder
        added: list[str] = []
        with deferred_interrupts():
            states.remove(freed_req_ids)
            try:
                for s in scheduled:  # per request a few list operations: this loop is the host's share
                    if len(s.block_ids) != num_groups:
                        raise ValueError(
                            f"Request {s.req_id!r} brings block ids for {len(s.block_ids)} KV cache groups, "
                            f"but the runner has {num_groups}."
                        )
                    row = row_of.get(s.req_id)
                    if row is None:
                        row = states.add(s.req_id, s.sampling, s.num_computed_tokens)
                        added.append(s.req_id)
                    if PLACEHOLDER_TOKEN_ID not in s.token_ids:
                        stage_tokens(row * width + s.num_computed_tokens, s.token_ids)
                    else:
                        self._stage_known(row, s, waiting)
                    stage_blocks(row, s.block_ids)
                    rows.append(row)
                states.apply()
                if waiting:
                    self._fill_placeholders(waiting, previous)
            except BaseException:
                states.discard()
                states.remove(added)
                raise
        return StepSchedule(
            [s.req_id for s in scheduled],
            np.array(rows, dtype=np.int32),
            np.array([len(s.token_ids) for s in scheduled], dtype=np.int32),
            np.array([s.num_computed_tokens for s in scheduled], dtype=np.int32),
            np.array([s.num_draft_tokens for s in scheduled], dtype=np.int32),
            np.array([s.samples for s in scheduled], dtype=bool),
        )

    def _stage_known(self, row: int, s: ScheduledTokens, waiting: list[tuple[int, int, str]]) -> None:
        """Stage the known ids of a token list that holds placeholders, run by run, and note where
        the previous step's sample goes (the last known token; draft placeholders are the draft
        model's to fill, on the device)."""
        ids, start, last_known = s.token_ids, s.num_computed_tokens, len(s.token_ids) - s.num_draft_tokens - 1
        run = None  # start of the current run of known ids
        for j, token in enumerate([*ids, PLACEHOLDER_TOKEN_ID]):
            if token != PLACEHOLDER_TOKEN_ID:
                run = j if run is None else run
                continue
            if run is not None:
                self.states.stage_tokens(row, start + run, ids[run:j])
                run = None
            if j == last_known:
                waiting.append((row, start + j, s.req_id))

    def _fill_placeholders(self, waiting: list[tuple[int, int, str]], previous: SampledTokens | None) -> None:
        """The previous step's samples into their rows, device to device: the host never waits for them."""
        if previous is None:
            raise ValueError(
                f"{len(waiting)} scheduled token(s) are placeholders, but no previous step's samples were "
                "given (execute_model's `previous`)."
            )
        index = {req_id: i for i, req_id in enumerate(previous.req_ids)}
        missing = [r for _, _, r in waiting if r not in index]
        if missing:
            raise ValueError(
                f"Requests {missing} have a placeholder token, but the previous step sampled none for them."
            )
        packed = np.array([(row, pos, index[r]) for row, pos, r in waiting], dtype=np.int64).T
        rows, positions, which = to_device(np.ascontiguousarray(packed), previous.token_ids.device)
        self.states.write_sampled(rows, positions, previous.token_ids[which])

    def common_attn_metadata(
        self, batch: InputBatch, kv_group: int, num_actual_tokens: int | None = None, uniform_decode: bool = False
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
            causal=self.kv_group_causal[kv_group],
            uniform_decode=uniform_decode,
        )

    def _build_metadata(
        self,
        batch: InputBatch,
        num_actual_tokens: int,
        for_cudagraph_capture: bool = False,
        uniform_decode: bool = False,
        attn_groups: list[list[AttentionGroup]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Layer name -> attention metadata (of `attn_groups`, default all), and layer name -> slot
        mapping, for one step."""
        commons = [
            self.common_attn_metadata(batch, g, num_actual_tokens, uniform_decode) for g in range(len(self.block_sizes))
        ]
        attn_metadata = build_attn_metadata(attn_groups or self.attn_groups, commons, for_cudagraph_capture)
        slot_mapping = {name: batch.slot_mappings[g] for name, g in self.layer_kv_group.items()}
        return attn_metadata, slot_mapping

    def prepare_inputs(
        self,
        scheduled: list[ScheduledTokens],
        previous: SampledTokens | None = None,
        freed_req_ids: list[str] | tuple[str, ...] = (),
    ) -> InputBatch:
        """The rows brought up to date, then the step's unpadded inputs gathered from them."""
        schedule = self.update_states(scheduled, previous, freed_req_ids)
        return prepare_inputs(self.states, schedule, self.buffers, self.block_sizes)

    @torch.inference_mode()
    def execute_model(
        self,
        scheduled: list[ScheduledTokens],
        previous: SampledTokens | None = None,
        freed_req_ids: list[str] | tuple[str, ...] = (),
    ) -> StepResult:
        """Run the model on the scheduled tokens; return logits of the requests that sample (with
        drafts: one row per draft and one after them). The rows of `freed_req_ids` are given back
        first. Placeholder tokens (async scheduling) take their ids from `previous`, and draft
        placeholders from the draft model, on the device."""
        with phase_range("prepare"):
            schedule = self.update_states(scheduled, previous, freed_req_ids)
            if self.drafter is not None and any(
                s.num_draft_tokens and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in scheduled
            ):
                self.drafter.propose(self.states, schedule, self._draft_forward)
            num_tokens = schedule.num_tokens
            # Uniform decode: every request runs its last token and all k drafts (1 + k query tokens).
            uniform_decode = bool((schedule.query_lens == self.uniform_decode_query_len).all())
            mode, descriptor = CUDAGraphMode.NONE, BatchDescriptor(num_tokens, uniform_decode)
            if self.dispatcher is not None:
                mode, descriptor = self.dispatcher.dispatch(num_tokens, uniform_decode)
            full = mode is CUDAGraphMode.FULL
            max_num_seqs = self.config.scheduler_config.max_num_seqs
            num_reqs = (
                cudagraph.capture_num_reqs(descriptor, max_num_seqs, self.uniform_decode_query_len) if full else None
            )
            batch = prepare_inputs(
                self.states, schedule, self.buffers, self.block_sizes, descriptor.num_tokens, num_reqs
            )
            # Built in FULL steps too: builders rewrite their persistent buffers (graphs read those).
            attn_metadata, slot_mapping = self._build_metadata(batch, descriptor.num_tokens if full else num_tokens)
        with phase_range("forward"):
            if full:
                assert self.full_graph is not None
                # The inputs are in the buffers the graph reads: no model code runs, so nothing
                # looks anything up, and no forward context is set.
                hidden = self.full_graph.replay(descriptor)
            else:
                with set_forward_context(
                    attn_metadata,
                    self.config,
                    slot_mapping=slot_mapping,
                    cudagraph_runtime_mode=mode,
                    batch_descriptor=descriptor,
                ):
                    hidden = self._forward(batch.input_ids, batch.positions)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            prompt_logits = self._prompt_logits(scheduled, batch, hidden)
            if self.drafter is not None:  # the draft model's KV cache catches up on the step's tokens
                with set_forward_context(attn_metadata, self.config, slot_mapping=slot_mapping):
                    self.drafter.model(batch.input_ids, batch.positions)
        draft_token_ids = batch.input_ids[batch.draft_indices] if schedule.num_draft_tokens.any() else None
        # The sampler's per-row parameters, gathered on the device from the request rows.
        with phase_range("sample"):
            samples = schedule.samples  # a request's 1 + k logits rows all read its row
            rows = np.repeat(schedule.rows[samples], 1 + schedule.num_draft_tokens[samples])
            sampling = self.states.sampling_metadata(rows, batch.positions[batch.logits_indices] + 1, batch.max_seq_len)
        return StepResult(
            batch, attn_metadata, slot_mapping, descriptor, logits, mode, draft_token_ids, sampling, prompt_logits
        )

    def _prompt_logits(
        self, scheduled: list[ScheduledTokens], batch: InputBatch, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """The logits of the prompt positions whose logprobs are asked for: the first
        `num_prompt_logits` query tokens of each such request (vLLM's runner does the same for
        prompt_logprobs, vllm/v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict)."""
        if not any(s.num_prompt_logits for s in scheduled):
            return None
        starts = batch.query_start_loc_cpu.tolist()
        indices = [range(start, start + s.num_prompt_logits) for start, s in zip(starts, scheduled)]
        rows = to_device([i for r in indices for i in r], hidden.device, torch.int64)
        return self.model.compute_logits(hidden[rows])

    def _draft_forward(self, schedule: StepSchedule) -> torch.Tensor:
        """One forward of the draft model over a small batch of its own (pagedkv/worker/draft_model.py)."""
        assert self.drafter is not None
        batch = prepare_inputs(self.states, schedule, self.buffers, self.block_sizes)
        attn_metadata, slot_mapping = self._build_metadata(batch, batch.num_tokens, attn_groups=self.draft_attn_groups)
        with set_forward_context(attn_metadata, self.config, slot_mapping=slot_mapping):
            hidden = self.drafter.model(batch.input_ids, batch.positions)
        return self.drafter.model.compute_logits(hidden[batch.logits_indices])
