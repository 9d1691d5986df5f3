"""Checks and device facts shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_SIZE = 16
MAX_HEAD_SIZE = 256


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (plain Python: `triton.cdiv` costs ~20 us per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tile shapes in Triton must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


def check_attention_dtype(dtype: torch.dtype, name: str) -> None:
    """Raise a readable error unless `dtype` is one the kernels compute in."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {dtype}; the Triton kernels support {list(SUPPORTED_DTYPES)}")


def check_head_size(head_size: int) -> None:
    """Any multiple of 8 in [16, 256]; tiles are padded to the next power of two (80, 96 -> 128)."""
    if not (MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE and head_size % 8 == 0):
        raise ValueError(
            f"head size {head_size} is not supported by the Triton kernels: use a multiple of 8 "
            f"from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE} (e.g. 64, 80, 96, 128, 256)"
        )


def interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`: kernels run on the CPU through numpy (tests, notebooks)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(tensor: torch.Tensor) -> None:
    """Triton compiles for GPUs; CPU tensors only work under its interpreter.

    Triton picks interpreted or compiled once, when `triton` is first imported (its own
    library functions such as `tl.sum` are made then), so the variable must be set before that.
    """
    if tensor.device.type != "cpu":
        return
    if not interpreting():
        raise RuntimeError(
            "Triton kernels got CPU tensors: use a CUDA device, or set TRITON_INTERPRET=1 before "
            "anything imports triton to run them (slowly) on the CPU"
        )
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported (torch._dynamo imports it, "
            "for one), so Triton is not in interpreter mode: set it before that import, e.g. at "
            "the top of the script or in conftest.py"
        )


@functools.lru_cache(maxsize=None)
def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a few, under the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
