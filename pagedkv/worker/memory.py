"""How much memory a device has left, and refusing an allocation that would not fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.config import EngineConfig
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheSpec, get_kv_cache_config

CPU_DEFAULT_KV_CACHE_BYTES = 64 * 2**20
"""The CPU's KV cache budget when none is given (no free-memory figure to size it from)."""


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
        raise ValueError(
            f"{what} needs {nbytes / 2**30:.2f} GiB on {device}, but only {available / 2**30:.2f} GiB "
            f"is available: {hint}"
        )


def kv_cache_config_for(
    config: EngineConfig,
    specs: dict[str, KVCacheSpec],
    device: torch.device,
    profile_run: Callable[[], None],
    max_blocks_per_request: int,
) -> KVCacheConfig:
    """The KV cache's block count: `num_kv_blocks`, or a memory budget (`kv_cache_memory`; on a GPU
    what `gpu_memory_utilization` leaves after the weights and `profile_run`'s activations; on the CPU
    CPU_DEFAULT_KV_CACHE_BYTES), never more than a full batch of max-length requests can use."""
    cache = config.cache_config
    if cache.num_kv_blocks is not None:
        return get_kv_cache_config(specs, num_blocks=cache.num_kv_blocks)
    profile_run()
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        # What is still free after the weights and the profile run's activations, minus the
        # share of the GPU the engine must leave alone (other engines in this process count too).
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1.0 - cache.gpu_memory_utilization) * total)
    else:
        budget = CPU_DEFAULT_KV_CACHE_BYTES
    kv_cache_config = get_kv_cache_config(specs, memory_bytes=max(budget, 0))
    if cache.kv_cache_memory is None:
        needed = config.scheduler_config.max_num_seqs * max_blocks_per_request + 1
        kv_cache_config.num_blocks = min(kv_cache_config.num_blocks, needed)
    return kv_cache_config
