"""Tensor parallelism over processes: the driver is rank 0, spawned workers hold the other shards.

    driver process (LLM: scheduler, KV cache manager, sampler)     worker processes, ranks 1..N-1
      rank 0: ModelRunner (its shard, its KV cache)                  ModelRunner (theirs)
      start-up: each rank sizes its cache; all take the minimum (all-reduce MIN of num_blocks);
                each captures the same CUDA graphs (FULL modes; on the GPU only)
      every step: broadcast (scheduled tokens, block ids)  ───────►  receive
                  execute_model   ◄─── 2 all-reduces per layer ──►   execute_model
                  logits (gathered on every rank) -> sampler          logits dropped
      shutdown:   broadcast None  ───────────────────────────────►  leave the loop, exit

Everything goes through torch.distributed (gloo on CPU, NCCL with one GPU per rank). The ranks
meet through a file (`file://` rendezvous), so no port has to be chosen. A worker that raises
prints its traceback and exits; its peers' next collective then fails (gloo notices the closed
connection at once; a hung rank hits the group's timeout), and the driver reports which rank
died instead of waiting.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.config import EngineConfig
from pagedkv.distributed import destroy_tensor_parallel, init_tensor_parallel
from pagedkv.worker.input_batch import ScheduledTokens
from pagedkv.worker.model_runner import ModelRunner, StepResult

if TYPE_CHECKING:
    from pagedkv.models.loader import HFConfig

TIMEOUT_S = 120.0
"""Longest a rank waits in one collective (a step, or start-up) before the group fails."""


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank `rank`'s copy of the config: its own GPU (cuda:rank), nothing else changes."""
    if config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device=torch.device("cuda", rank))


def _start_rank(config: EngineConfig, model_config: HFConfig, rank: int, init_method: str) -> ModelRunner:
    """Join the group, build this rank's shard and its KV cache, sized like every other rank's."""
    config = _rank_config(config, rank)
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    init_tensor_parallel(rank, config.parallel_config.tensor_parallel_size, init_method, backend, TIMEOUT_S)
    runner = ModelRunner(config, model_config)
    kv_cache_config = runner.determine_kv_cache_config()
    # Each rank holds only its heads, but all must agree on one block count: the smallest.
    num_blocks = torch.tensor([kv_cache_config.num_blocks], device=config.device)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
    kv_cache_config.num_blocks = int(num_blocks.item())
    runner.initialize_kv_cache(kv_cache_config)
    # Every rank captures the same graphs in the same order, so their all-reduces pair up
    # (NCCL collectives are captured into the graph like any kernel).
    runner.capture_model()
    return runner


def _worker_main(config: EngineConfig, model_config: HFConfig, rank: int, init_method: str, started: Any) -> None:
    """A worker process: run every step the driver broadcasts until it broadcasts None."""
    started.set()  # the process came up (see `TensorParallelExecutor._wait_for_workers`)
    try:
        runner = _start_rank(config, model_config, rank, init_method)
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is None:
                break
            runner.execute_model(*message[0])
        destroy_tensor_parallel()
    except BaseException:  # noqa: BLE001 -- reported by the driver as this rank's death
        traceback.print_exc()
        os._exit(1)  # at once: no exit handler may wait on a collective the driver will never join


class TensorParallelExecutor:
    """Runs every step on all ranks; the driver's own runner (rank 0) is `self.runner`."""

    def __init__(self, config: EngineConfig, model_config: HFConfig) -> None:
        tp = config.parallel_config.tensor_parallel_size
        fd, rendezvous = tempfile.mkstemp(prefix="pagedkv-tp-")
        os.close(fd)
        init_method = f"file://{rendezvous}"
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, tp)]
        self.workers = [
            context.Process(target=_worker_main, args=(config, model_config, rank, init_method, started[rank - 1]),
                            name=f"pagedkv-tp-rank{rank}", daemon=True)
            for rank in range(1, tp)
        ]
        for worker in self.workers:
            worker.start()
        self._closed = False
        self._told_to_stop = [False]  # shared with the finalizer, which must not hold `self`
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, rendezvous, self._told_to_stop)
        try:
            self._wait_for_workers(started)
            self.runner = _start_rank(config, model_config, 0, init_method)
        except BaseException:  # e.g. no backend serves the per-rank layout: that error, not a rank's death
            self._closed = True
            self._finalizer()  # the workers fail the same way or wait for rank 0: end them
            raise

    def _wait_for_workers(self, started: list[Any]) -> None:
        """Fail at once if a worker dies before it runs `_worker_main`, rather than after the
        group's start-up timeout. Usually a script that creates the LLM outside an
        `if __name__ == "__main__":` block: each spawned worker imports the script again."""
        deadline = time.monotonic() + TIMEOUT_S
        for rank, (worker, event) in enumerate(zip(self.workers, started), start=1):
            while not event.wait(0.05) and time.monotonic() < deadline:
                if worker.exitcode is not None:
                    raise RuntimeError(
                        f"Tensor-parallel worker rank {rank} exited with code {worker.exitcode} while starting (its "
                        "traceback is above). Workers are spawned processes that import your main script again: "
                        "in a script, create the LLM under `if __name__ == \"__main__\":`."
                    )

    def execute_model(self, scheduled: list[ScheduledTokens], block_ids: dict[str, list[list[int]]]) -> StepResult:
        if self._closed:
            raise RuntimeError("This tensor-parallel engine was shut down (or lost a rank); create a new LLM.")
        try:
            dist.broadcast_object_list([(scheduled, block_ids)], src=0)
            return self.runner.execute_model(scheduled, block_ids)
        except Exception as error:
            self._fail(error)

    def _fail(self, error: Exception) -> NoReturn:
        """A collective failed: name the ranks that died (if any), end the group, raise."""
        for worker in self.workers:
            worker.join(timeout=5)  # a dead peer is usually why; give its exit a moment to show
        dead = [f"rank {i + 1} " + (f"was killed by signal {-w.exitcode}" if w.exitcode < 0 else
                                    f"exited with code {w.exitcode} (its traceback is above)")
                for i, w in enumerate(self.workers) if w.exitcode is not None]
        self._closed = True
        self._finalizer()
        reason = f"worker {', '.join(dead)}" if dead else f"{type(error).__name__}: {error}"
        raise RuntimeError(f"Tensor-parallel step failed: {reason}. The engine cannot continue.") from error

    def shutdown(self) -> None:
        """Tell the workers to leave, wait for them, and leave the group (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        try:
            dist.broadcast_object_list([None], src=0)
            self._told_to_stop[0] = True
        except Exception:  # noqa: BLE001 -- a broken group: the finalizer below ends the workers
            pass
        self._finalizer()


def _shut_down(workers: list[Any], rendezvous: str, told_to_stop: list[bool]) -> None:
    """End the workers (wait for those told to stop, terminate the others: garbage collection or
    interpreter exit without `shutdown()`), leave the group, remove the rendezvous file."""
    for worker in workers:
        worker.join(timeout=10 if told_to_stop[0] else 0)
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=5)
    destroy_tensor_parallel()
    if os.path.exists(rendezvous):
        os.unlink(rendezvous)
