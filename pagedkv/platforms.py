"""Platforms: what a device type can run and which attention backends it prefers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """One device type: its name, backend preference order and op style."""

    device_type: str
    backend_priority: tuple[str, ...]
    """Backends tried in this order when none is chosen explicitly."""

    def opaque_attention_op(self) -> bool:
        """Call attention through one opaque custom op (CPU and CUDA do: torch.compile splits there)."""
        return self.device_type in ("cpu", "cuda")


# MHA backends first, then MLA ones: each kind rejects the other's layers, so a layer gets
# the first backend of its own kind.
CPU = Platform("cpu", backend_priority=("TORCH_REF", "TORCH_REF_MLA"))
CUDA = Platform("cuda", backend_priority=("FLASH_ATTN", "TRITON_ATTN", "TORCH_REF", "TRITON_MLA", "TORCH_REF_MLA"))


def get_platform(device: torch.device | str) -> Platform:
    """The platform of `device` ("cpu", "cuda", "cuda:1", ...)."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        return CUDA
    if device_type == "cpu":
        return CPU
    return Platform(device_type, backend_priority=("TORCH_REF", "TORCH_REF_MLA"))


def default_device() -> torch.device:
    """CUDA when a GPU is visible, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
