"""The tensor-parallel group of one engine, on its own `torch.distributed` process groups.

Every tensor-parallel engine owns a `TensorParallelGroup`: this process's rank, the rank count, and
process groups made for that engine alone on its own store (gloo on the CPU; on CUDA an NCCL group
for the model's collectives beside the gloo one, as vLLM's GroupCoordinator keeps a `cpu_group`
and a `device_group`, vllm/distributed/parallel_state.py). torch.distributed's process-wide
default group is never used, so any number of engines, tensor-parallel or not, live side by side.

A group counts only while it is *active*, inside `tensor_parallel(group)`: the driver enters it to
build its runner and to run each step, a worker process for its whole life. The parallel layers
(pagedkv/models/parallel_layers.py) take their rank and size from the active group when they are
built and run its collectives when they run. With none active (a single-rank engine) the rank is
0 of 1 and every collective returns its input. Engines are driven from one thread at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.config import CompilationConfig, ParallelConfig, get_current_engine_config, set_current_engine_config


@dataclass(frozen=True)
class TensorParallelGroup:
    """One engine's ranks as seen from one of its processes, and the groups they talk over."""

    rank: int
    """This process's rank (the driver is 0)."""
    world_size: int
    """The engine's tensor_parallel_size."""
    store: Any
    """The engine's own rendezvous store (a `torch.distributed.FileStore`): start-up exchanges go through it."""
    device_group: Any
    """The model's all-reduces and all-gathers (gloo on the CPU, NCCL on CUDA)."""
    cpu_group: Any
    """Gloo, for the driver's step messages (the same group as `device_group` on the CPU)."""


def new_tensor_parallel_group(
    rank: int, world_size: int, rendezvous: str, device: torch.device, timeout_s: float
) -> TensorParallelGroup:
    """Join the engine whose ranks meet at file `rendezvous` (blocks until all `world_size` ranks
    joined). `timeout_s` bounds every collective: a rank that stops answering becomes an error."""
    store = dist.FileStore(rendezvous, world_size)
    timeout = timedelta(seconds=timeout_s)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, world_size, timeout)
    device_group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = cpu_group
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, world_size, options)
    return TensorParallelGroup(rank, world_size, store, device_group, cpu_group)


def close_tensor_parallel_group(group: TensorParallelGroup) -> None:
    """Free an NCCL communicator once every rank is done with it (gloo frees itself)."""
    if group.device_group is not group.cpu_group:
        group.device_group.shutdown()


_ACTIVE: TensorParallelGroup | None = None


@contextlib.contextmanager
def tensor_parallel(group: TensorParallelGroup | None) -> Iterator[None]:
    """Make `group` the one the parallel layers are built for and talk over (None: a single rank)."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, group
    try:
        yield
    finally:
        _ACTIVE = saved


def get_tp_rank() -> int:
    return 0 if _ACTIVE is None else _ACTIVE.rank


def get_tp_size() -> int:
    """Ranks of the active group. Outside one: the tensor_parallel_size of the engine config being
    built, so a sandbox can build rank 0's layers to look at their shapes (as notebook 01 does);
    their collectives then do nothing."""
    if _ACTIVE is not None:
        return _ACTIVE.world_size
    return get_current_engine_config().parallel_config.tensor_parallel_size


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Build layers as the only rank (the whole model) inside a tensor-parallel process, with a
    fresh layer registry: e.g. to draw a preset's random weights once, the same on every rank."""
    config = dataclasses.replace(
        get_current_engine_config(), parallel_config=ParallelConfig(1), compilation_config=CompilationConfig()
    )
    with tensor_parallel(None), set_current_engine_config(config):
        yield


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks (in place), e.g. the partial products of a row-parallel layer."""
    if _ACTIVE is not None and _ACTIVE.world_size > 1:
        _ACTIVE.device_group.allreduce([x]).wait()
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order (e.g. vocabulary shards of logits)."""
    if _ACTIVE is None or _ACTIVE.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_ACTIVE.world_size)]
    _ACTIVE.device_group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


def broadcast_object(group: TensorParallelGroup, obj: object, wait_s: float | None = None) -> object:
    """Rank 0's `obj` on every rank (pickled, over the gloo group: its size, then its bytes); the
    other ranks pass anything and get rank 0's. `wait_s`: how long this rank waits for the others
    to begin (default: the group's timeout), e.g. much longer for a worker waiting for work."""
    if group.rank == 0:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    options = dist.BroadcastOptions()
    if wait_s is not None:
        options.timeout = timedelta(seconds=wait_s)
    group.cpu_group.broadcast([size], options).wait()
    if group.rank != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.cpu_group.broadcast([payload]).wait()
    return obj if group.rank == 0 else pickle.loads(payload.numpy().tobytes())
