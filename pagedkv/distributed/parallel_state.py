"""The tensor-parallel group of this process, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

One group per process: the engine's driver is rank 0, each worker process one more rank, and
every rank holds one shard of the model (see pagedkv/models/parallel_layers.py). Without a group
(the single-process engine) the rank is 0 of 1 and every collective returns its input.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedkv.config import CompilationConfig, ParallelConfig, get_current_engine_config, set_current_engine_config


@dataclass(frozen=True)
class _Group:
    rank: int
    world_size: int


_TP: _Group | None = None


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Join the group (blocks until all `world_size` ranks joined). `timeout_s` bounds every
    collective: a rank that stops answering becomes an error instead of a hang."""
    global _TP
    if _TP is not None:
        raise RuntimeError(
            "This process is already in a tensor-parallel group: shut the other tensor-parallel LLM down "
            "(llm.shutdown()) before starting another."
        )
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _TP = _Group(rank, world_size)


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP = None


def get_tp_rank() -> int:
    return 0 if _TP is None else _TP.rank


def get_tp_size() -> int:
    """Ranks in this process's group. Outside a group: the tensor_parallel_size of the engine
    config being built, so a sandbox can build rank 0's layers to look at their shapes (as
    notebook 01 does); their collectives then do nothing."""
    if _TP is not None:
        return _TP.world_size
    return get_current_engine_config().parallel_config.tensor_parallel_size


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Build layers as the only rank (the whole model) inside a tensor-parallel process, with a
    fresh layer registry: e.g. to draw a preset's random weights once, the same on every rank."""
    global _TP
    config = dataclasses.replace(get_current_engine_config(), parallel_config=ParallelConfig(1),
                                 compilation_config=CompilationConfig())
    saved, _TP = _TP, None
    try:
        with set_current_engine_config(config):
            yield
    finally:
        _TP = saved


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks (in place), e.g. the partial products of a row-parallel layer."""
    if _TP is not None and _TP.world_size > 1:
        dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order (e.g. vocabulary shards of logits)."""
    if _TP is None or _TP.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
