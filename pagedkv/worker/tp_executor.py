"""Tensor parallelism over processes: the driver is rank 0, spawned workers hold the other shards.

    driver process (LLM: scheduler, KV cache manager, sampler)     worker processes, ranks 1..N-1
      rank 0: ModelRunner (its shard, its KV cache)                  ModelRunner (theirs)
      start-up: each rank loads its shard; through the engine's store they wait for each other
                and take the smallest KV cache (num_blocks); each captures the same CUDA graphs
      every step: broadcast (scheduled tokens, block ids)  ───────►  receive
                  execute_model   ◄─── 2 all-reduces per layer ──►   execute_model
                  logits (gathered on every rank) -> sampler          logits dropped
      shutdown:   broadcast None  ───────────────────────────────►  leave the loop, exit

Each engine has its own process groups on its own store (pagedkv/distributed/parallel_state.py),
met through a file, so no port has to be chosen and engines do not share anything. Faults:

- a worker that raises prints its traceback and exits; the driver's next collective fails at once
  (gloo notices the closed connection) and names the rank;
- a stopped or hung worker: every step collective times out (after STEP_TIMEOUT_S); each worker
  beats a heartbeat into shared memory, and the driver names the rank whose heart stopped;
- either way the engine raises `EngineDeadError`, ends its workers, and refuses further steps;
- Ctrl-C: workers ignore SIGINT (the driver decides); a SIGINT in the driver during a step is
  held until every rank has finished the step, then raised as KeyboardInterrupt, so the ranks
  stay in step and the engine can run again (it discards that step's result).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.attention.selector import ENV_VAR, register_backend, user_backends
from pagedkv.config import EngineConfig
from pagedkv.distributed import (
    TensorParallelGroup,
    broadcast_object,
    close_tensor_parallel_group,
    new_tensor_parallel_group,
    tensor_parallel,
)
from pagedkv.interrupts import deferred_interrupts
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, SampledTokens, ScheduledTokens
from pagedkv.worker.model_runner import ModelRunner, StepResult

if TYPE_CHECKING:
    from pagedkv.models.loader import HFConfig

STARTUP_TIMEOUT_S = 600.0
"""Longest start-up waits for the slowest rank (loading a large checkpoint takes a while)."""
STEP_TIMEOUT_ENV = "PAGEDKV_TP_STEP_TIMEOUT_S"
STEP_TIMEOUT_S = 20.0
"""Longest a rank waits in one collective of a step before the engine is declared dead (default;
$PAGEDKV_TP_STEP_TIMEOUT_S sets another, e.g. for a large model's slow steps on the CPU)."""
IDLE_TIMEOUT_S = 365 * 24 * 3600.0
"""How long a worker waits for the driver's next step: an idle engine is no fault."""
HEARTBEAT_S = 1.0
"""How often a worker says it is alive (from a thread of its own)."""
SILENT_S = 3 * HEARTBEAT_S
"""A worker silent this long when a step's collective failed has stopped (or hangs)."""
SILENT_STARTING_S = 30 * HEARTBEAT_S
"""The same while starting, where a long call that holds the GIL (loading weights) must not count."""


class EngineDeadError(RuntimeError):
    """This tensor-parallel engine cannot continue (a rank died or stopped answering): create a new LLM."""


def step_timeout_s() -> float:
    """The step collectives' timeout: $PAGEDKV_TP_STEP_TIMEOUT_S if set, else STEP_TIMEOUT_S."""
    raw = os.environ.get(STEP_TIMEOUT_ENV)
    if raw is None:
        return STEP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"${STEP_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}.")
    return value


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank `rank`'s copy of the config: its own GPU (cuda:rank), nothing else changes."""
    if config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device=torch.device("cuda", rank))


def _join(
    config: EngineConfig, rank: int, rendezvous: str, timeout_s: float
) -> tuple[EngineConfig, TensorParallelGroup]:
    """Rank `rank`'s config (its own GPU) and its place in the engine's group."""
    config = _rank_config(config, rank)
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    return config, new_tensor_parallel_group(
        rank, config.parallel_config.tensor_parallel_size, rendezvous, config.device, timeout_s
    )


def _exchange_at_start(group: TensorParallelGroup, key: str, value: int, check_peers: Callable[[], None]) -> list[int]:
    """Every rank's `value`, through the store: waits as long as the slowest rank needs (its weights
    may take minutes to load, longer than a step's collectives may wait), but not for a dead one."""
    group.store.set(f"{key}/{group.rank}", str(value))
    keys = [f"{key}/{rank}" for rank in range(group.world_size)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            group.store.wait(keys, timedelta(seconds=0.1))
            break
        except RuntimeError:  # the wait timed out (FileStore raises a plain RuntimeError for that)
            check_peers()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Tensor-parallel start-up: not every rank got to {key!r} within {STARTUP_TIMEOUT_S:.0f} s."
                ) from None
    return [int(group.store.get(k)) for k in keys]


def _start_rank(
    config: EngineConfig, model_config: HFConfig, group: TensorParallelGroup, check_peers: Callable[[], None]
) -> ModelRunner:
    """Build this rank's shard (the group active) and its KV cache, sized like every other rank's."""
    runner = ModelRunner(config, model_config)
    _exchange_at_start(group, "loaded", 1, check_peers)  # the profile run's collectives start together
    kv_cache_config = runner.determine_kv_cache_config()
    # Each rank holds only its heads, but all must agree on one block count: the smallest.
    kv_cache_config.num_blocks = min(_exchange_at_start(group, "num_blocks", kv_cache_config.num_blocks, check_peers))
    runner.initialize_kv_cache(kv_cache_config)
    # Every rank captures the same graphs in the same order, so their all-reduces pair up
    # (NCCL collectives are captured into the graph like any kernel).
    runner.capture_model()
    return runner


def _heartbeat(beats: Any, index: int) -> None:
    while True:
        beats[index] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes of the machine
        time.sleep(HEARTBEAT_S)


def _worker_main(
    config: EngineConfig,
    model_config: HFConfig,
    rank: int,
    rendezvous: str,
    timeout_s: float,
    backends: list[tuple[str, str, bool]],
    started: Any,
    beats: Any,
) -> None:
    """A worker process: run every step the driver broadcasts until it broadcasts None."""
    threading.Thread(target=_heartbeat, args=(beats, rank - 1), daemon=True).start()
    driver = os.getppid()

    def check_driver() -> None:
        if os.getppid() != driver:
            raise RuntimeError("the driver process exited during start-up")

    started.set()  # the process came up (see `TensorParallelExecutor._wait_for_workers`)
    try:
        for module, qualname, prefer in backends:  # the driver's registry (see `_workers_backends`)
            register_backend(_import_class(module, qualname), prefer=prefer)
        config, group = _join(config, rank, rendezvous, timeout_s)
        with tensor_parallel(group):  # for this process's whole life
            runner = _start_rank(config, model_config, group, check_driver)
            while (message := broadcast_object(group, None, wait_s=IDLE_TIMEOUT_S)) is not None:
                assert isinstance(message, tuple)  # the driver's (scheduled, previous, freed_req_ids)
                runner.execute_model(*message)
        close_tensor_parallel_group(group)
    except BaseException:  # noqa: BLE001 -- reported by the driver as this rank's death
        traceback.print_exc()
        os._exit(1)  # at once: no exit handler may wait on a collective the driver will never join


def _import_class(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _workers_backends(config: EngineConfig) -> list[tuple[str, str, bool]]:
    """The attention backends registered in this process that the engine may pick (named by it
    or preferred), as (module, class, prefer), for the workers to register too. A class the
    workers cannot import by name is refused here, at once."""
    named = {config.attention_backend, os.environ.get(ENV_VAR), *config.layer_attention_backends.values()}
    backends = []
    for cls, prefer in user_backends():
        if not prefer and cls.get_name() not in named:
            continue
        module, qualname = cls.__module__, cls.__qualname__
        try:
            importable = module not in ("__main__", "__mp_main__") and _import_class(module, qualname) is cls
        except (ImportError, AttributeError):
            importable = False
        if not importable:
            raise ValueError(
                f"Attention backend {cls.get_name()!r} ({module}.{qualname}) is registered only in this process: "
                "tensor-parallel workers are separate processes and do not have it. Define the class in a module "
                "they can import (e.g. my_backends.py beside the notebook, `from my_backends import MyBackend`) "
                "and register it from there; each worker then registers it by that module path."
            )
        backends.append((module, qualname, prefer))
    return backends


@contextlib.contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    """SIGINT handled by `handler` meanwhile (only the main thread can set handlers: elsewhere, as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class TensorParallelExecutor:
    """Runs every step on all ranks; the driver's own runner (rank 0) is `self.runner`."""

    def __init__(self, config: EngineConfig, model_config: HFConfig) -> None:
        tp = config.parallel_config.tensor_parallel_size
        backends = _workers_backends(config)
        timeout_s = step_timeout_s()
        fd, rendezvous = tempfile.mkstemp(prefix="pagedkv-tp-")
        os.close(fd)
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, tp)]
        self._beats = context.RawArray("d", [time.monotonic()] * (tp - 1))
        self.workers = [
            context.Process(
                target=_worker_main,
                name=f"pagedkv-tp-rank{rank}",
                daemon=True,
                args=(config, model_config, rank, rendezvous, timeout_s, backends, started[rank - 1], self._beats),
            )
            for rank in range(1, tp)
        ]
        # A terminal's Ctrl-C reaches the whole process group; the driver alone decides what it
        # means. Ignored SIGINT survives the spawn (exec), and Python then installs no handler.
        with _sigint(signal.SIG_IGN):
            for worker in self.workers:
                worker.start()
        self._dead: str | None = None
        """Why the engine cannot continue (set once it cannot)."""
        self._told_to_stop = [False]  # shared with the finalizer, which must not hold `self`
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, rendezvous, self._told_to_stop)
        try:
            self._wait_for_workers(started)
            rank_config, self.group = _join(config, 0, rendezvous, timeout_s)
            with tensor_parallel(self.group):
                self.runner = _start_rank(rank_config, model_config, self.group, self._check_workers)
        except BaseException as error:  # e.g. no backend serves the per-rank layout: that error, not a rank's death
            self._dead = "it did not start"
            lost = self._lost_ranks(starting=True) if isinstance(error, dist.DistError) else ""
            self._finalizer()  # the workers fail the same way or wait for rank 0: end them
            if lost:  # a collective failed because a worker was gone: say which
                raise EngineDeadError(f"Tensor-parallel start-up failed: {lost}.") from error
            raise

    def _wait_for_workers(self, started: list[Any]) -> None:
        """Fail at once if a worker dies before it runs `_worker_main`, rather than after the
        start-up timeout. Usually a script that creates the LLM outside an
        `if __name__ == "__main__":` block: each spawned worker imports the script again."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (worker, event) in enumerate(zip(self.workers, started), start=1):
            while not event.wait(0.05) and time.monotonic() < deadline:
                if worker.exitcode is not None:
                    raise RuntimeError(
                        f"Tensor-parallel worker rank {rank} exited with code {worker.exitcode} while starting (its "
                        "traceback is above). Workers are spawned processes that import your main script again: "
                        'in a script, create the LLM under `if __name__ == "__main__":`.'
                    )

    def _lost_ranks(self, starting: bool = False) -> str:
        """The workers that exited or whose heartbeat stopped, in words ('' if none)."""
        now = time.monotonic()
        lost = []
        for rank, worker in enumerate(self.workers, start=1):
            if worker.exitcode is not None:
                lost.append(
                    f"worker rank {rank} "
                    + (
                        f"was killed by signal {-worker.exitcode}"
                        if worker.exitcode < 0
                        else f"exited with code {worker.exitcode} (its traceback is above)"
                    )
                )
            elif now - self._beats[rank - 1] > (SILENT_STARTING_S if starting else SILENT_S):
                lost.append(
                    f"worker rank {rank} (pid {worker.pid}) stopped answering: no heartbeat for "
                    f"{now - self._beats[rank - 1]:.0f} s (stopped with SIGSTOP, or hung)"
                )
        return "; ".join(lost)

    def _check_workers(self) -> None:
        lost = self._lost_ranks(starting=True)
        if lost:
            raise EngineDeadError(f"Tensor-parallel start-up failed: {lost}.")

    def execute_model(
        self,
        scheduled: list[ScheduledTokens],
        previous: SampledTokens | None = None,
        freed_req_ids: list[str] | tuple[str, ...] = (),
    ) -> StepResult:
        """Run one step on every rank. The ranks get plain values from the driver, so placeholder
        tokens (async scheduling) are filled in here on the host: the driver waits for the last
        step's samples, and async scheduling overlaps nothing under tensor parallelism (vLLM
        broadcasts the sampled ids between ranks on the device instead)."""
        if previous is not None and any(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in scheduled):
            ids = dict(zip(previous.req_ids, previous.token_ids.tolist()))
            scheduled = [
                dataclasses.replace(s, token_ids=[*s.token_ids[:-1], ids[s.req_id]])
                if s.token_ids[-1] == PLACEHOLDER_TOKEN_ID
                else s
                for s in scheduled
            ]
        if self._dead is not None:
            raise EngineDeadError(f"This tensor-parallel engine cannot continue ({self._dead}); create a new LLM.")
        # A SIGINT now would leave the other ranks inside this step's collectives, waiting for
        # ones rank 0 never joins: hold it until the step is done everywhere (it is raised then,
        # and the engine runs the step again).
        with deferred_interrupts(), tensor_parallel(self.group):
            try:
                broadcast_object(self.group, (scheduled, None, freed_req_ids))
                return self.runner.execute_model(scheduled, None, freed_req_ids)
            except Exception as error:
                self._fail(error)

    def _fail(self, error: Exception) -> NoReturn:
        """A collective failed: name the ranks lost (if any), end the workers, raise."""
        deadline = time.monotonic() + 2
        while not (lost := self._lost_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)  # a dead peer is usually why; give its exit a moment to show
        self._dead = lost or f"{type(error).__name__}: {error}"
        self._finalizer()
        raise EngineDeadError(
            f"Tensor-parallel step failed: {self._dead}. The engine cannot continue; create a new LLM."
        ) from error

    def shutdown(self) -> None:
        """Tell the workers to leave, wait for them, and leave the group (safe to call twice)."""
        if self._dead is not None:
            return
        self._dead = "it was shut down"
        try:
            broadcast_object(self.group, None)
            self._told_to_stop[0] = True
        except Exception:  # noqa: BLE001 -- a broken group: the finalizer below ends the workers
            pass
        self._finalizer()
        if self._told_to_stop[0]:  # every rank left its loop: nobody uses the group any more
            close_tensor_parallel_group(self.group)


def _shut_down(workers: list[Any], rendezvous: str, told_to_stop: list[bool]) -> None:
    """End the workers (wait for those told to stop, kill the others: garbage collection or
    interpreter exit without `shutdown()`, a lost rank) and remove the rendezvous file."""
    for worker in workers:
        worker.join(timeout=10 if told_to_stop[0] else 0)
        if worker.is_alive():
            worker.kill()  # SIGKILL: it also ends a stopped process, which SIGTERM would not
            worker.join(timeout=5)
    if os.path.exists(rendezvous):
        os.unlink(rendezvous)
