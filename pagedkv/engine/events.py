"""What the engine reports about itself: counters over its life (`EngineStats`, `LLM.stats`) and,
after every step, a `StepEvent` for each listener (`LLM.add_step_listener`: trace recorders,
widgets, exercise checkers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.worker.model_runner import ModelRunner, StepResult


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    num_steps: int = 0
    num_steps_by_graph_mode: dict[str, int] = field(default_factory=dict)
    """How the steps ran: "FULL" (one CUDA graph replayed), "PIECEWISE" or "NONE" (eager) -> steps."""
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    """Prompt (and recomputed) tokens run through the model."""
    num_decode_tokens: int = 0
    num_finished_requests: int = 0
    model_time_s: float = 0.0
    num_cached_tokens: int = 0
    """Prompt (and recomputed) tokens found in the prefix cache, so not run through the model."""
    num_lookup_tokens: int = 0
    """Tokens of the requests admitted (new or resumed), all looked up in the prefix cache."""

    num_draft_tokens: int = 0
    """Speculative decoding: drafts verified (proposed and scheduled)."""
    num_accepted_tokens: int = 0
    """Drafts the target accepted."""
    num_verified_steps: int = 0
    """Request-steps that verified drafts (each also emits one token of the target's own)."""

    def count_step(self, sched: SchedulerOutput, cudagraph_mode: str, num_finished: int) -> None:
        """Add one booked step: its tokens, how it ran, the requests it finished, its drafts."""
        self.num_steps += 1
        self.num_steps_by_graph_mode[cudagraph_mode] = self.num_steps_by_graph_mode.get(cudagraph_mode, 0) + 1
        self.num_prefill_tokens += sched.num_prefill_tokens
        self.num_decode_tokens += sched.num_decode_tokens
        self.num_finished_requests += num_finished
        self.num_cached_tokens += sum(s.num_cached_tokens for s in sched.scheduled)
        self.num_lookup_tokens += sum(s.num_lookup_tokens for s in sched.scheduled)
        verified = [s for s in sched.scheduled if s.num_accepted_tokens is not None]
        self.num_draft_tokens += sum(len(s.draft_token_ids) for s in verified)
        self.num_accepted_tokens += sum(s.num_accepted_tokens or 0 for s in verified)
        self.num_verified_steps += len(verified)

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request emitted per verifying step: 1 + its accepted drafts, averaged (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_verified_steps if self.num_verified_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """num_cached_tokens / num_lookup_tokens (0 before any lookup)."""
        return self.num_cached_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0


@dataclass
class StepEvent:
    """Everything a listener (trace recorder, widget) may want to know about one step.

    Read it inside the listener: `result` holds views of the runner's persistent buffers (the
    device block tables, for one), which the next step overwrites. `block_ids` is a copy.
    """

    step: int
    scheduler_output: SchedulerOutput
    result: StepResult
    block_ids: dict[str, list[list[int]]]
    """Request id -> per KV cache group, its block table row during the step."""
    num_free_blocks: list[int]
    """Per KV cache group, after the step."""
    finished_req_ids: list[str]
    runner: ModelRunner = field(repr=False)


StepListener = Callable[[StepEvent], None]
