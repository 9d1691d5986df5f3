"""How much memory a device has left, and refusing an allocation that would not fit."""

from __future__ import annotations

from pathlib import Path

import torch


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
