"""Checks and device facts shared by the Triton kernels."""

from __future__ import annotations

import functools
import os
from typing import TypeVar

import torch

T = TypeVar("T")

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_SIZE = 16
MAX_HEAD_SIZE = 256


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (plain Python: `triton.cdiv` costs ~20 us per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tile shapes in Triton must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


def by_size(table: tuple[tuple[int | None, T], ...], size: int) -> T:
    """The value of the first (largest size, value) bucket of `table` that holds `size`; the last
    bucket's bound is None (any size). The mode's tile tables are looked up so (the matmul's by M,
    the attention's by a request's query rows)."""
    for bound, value in table:
        if bound is None or size <= bound:
            return value
    raise ValueError(f"size {size} is past every bucket of {table}: end the table with a (None, tiles) bucket")


def check_attention_dtype(dtype: torch.dtype, name: str) -> None:
    """Raise a readable error unless `dtype` is one the kernels compute in."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {dtype}; the Triton kernels support {list(SUPPORTED_DTYPES)}")


def head_size_supported(head_size: int) -> bool:
    """Any multiple of 8 in [16, 256]; tiles are padded to the next power of two (80, 96 -> 128)."""
    return MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE and head_size % 8 == 0


def check_head_size(head_size: int) -> None:
    """`head_size_supported`, or a ValueError that says which sizes work."""
    if not head_size_supported(head_size):
        raise ValueError(
            f"head size {head_size} is not supported by the Triton kernels: use a multiple of 8 "
            f"from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE} (e.g. 64, 80, 96, 128, 256)"
        )


def interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`: kernels run on the CPU through numpy (tests, notebooks)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETER_HINT = (
    "set TRITON_INTERPRET=1 in the environment before Python starts (or at least before anything "
    "imports triton: pagedkv.kernels, torch.compile and transformers may)"
)


def interpreter_problem() -> str | None:
    """Why Triton cannot run kernels on CPU tensors in this process; None when its interpreter is on.

    Triton chooses interpreted or compiled per function, when `@triton.jit` wraps it: its own
    library (`tl.sum`, `tl.max`, ...) when `triton` is first imported, these kernels when
    `pagedkv.kernels` is. So `TRITON_INTERPRET=1` must already be set at those imports; setting
    it later leaves compiled functions that cannot take CPU tensors.
    """
    if not interpreting():
        return f"on the CPU, Triton runs only in its interpreter: {INTERPRETER_HINT}"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        return (
            "TRITON_INTERPRET=1 was set after triton had been imported, so Triton is not in its "
            f"interpreter: {INTERPRETER_HINT}"
        )
    return _interpreter_loop_problem()


@functools.lru_cache(maxsize=None)
def _interpreter_loop_problem() -> str | None:
    """Whether the interpreter can run a loop whose bound comes from a loaded value, as every
    kernel here does. Triton 3.6's interpreter turns that bound into a Python int through a
    one-element numpy array, which numpy 2.4 refuses; Triton 3.8 squeezes it first. Probed by
    running a one-program kernel once, so any other pair of versions is judged by what it does."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def count_pairs(n_ptr, out_ptr):
        count = 0
        for _ in range(0, tl.cdiv(tl.load(n_ptr), 2)):
            count += 1
        tl.store(out_ptr, count)

    # On the CPU by name: the first call may come while a model is built under `torch.device("meta")`,
    # whose tensors have no data to run on (and this answer is kept for the process's life).
    try:
        count_pairs[(1,)](
            torch.tensor([5], dtype=torch.int32, device="cpu"), torch.zeros(1, dtype=torch.int32, device="cpu")
        )
    except Exception as exc:  # the interpreter wraps the TypeError in its own error
        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop bounded by a loaded value with "
            f"numpy {numpy.__version__} ({str(exc).splitlines()[0][:100]}): install triton>=3.8, or numpy<2.4"
        )
    return None


def check_tensors(**tensors: torch.Tensor) -> None:
    """A kernel's arguments, checked first: tensors, all on one device, and one that can run the
    kernels (Triton compiles for GPUs; CPU tensors only work under its interpreter)."""
    first, device = None, None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if device is None:
            first, device = name, tensor.device
        elif tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, {first} on {device}: put them on one device")
    if device is None or device.type != "cpu":
        return
    problem = interpreter_problem()
    if problem:
        raise RuntimeError(f"Triton kernels got CPU tensors (use a CUDA device to run them compiled); {problem}")


def check_pages_on_cpu(block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """The pages a batch reads, checked where that is free: on CPU tensors (Triton's interpreter,
    no device to wait for). A length past the block table or a block id past the cache makes a
    kernel read outside its tensors: on the CPU a segfault, which takes the Python (or Jupyter)
    process down. On a GPU the check would cost a device sync per call, so there the kernels
    trust their metadata, as vLLM's do. `seq_lens` has one entry per row of the batch."""
    if seq_lens.device.type != "cpu" or seq_lens.numel() == 0:
        return
    max_blocks = block_table.shape[1]
    if seq_lens.min() < 0 or seq_lens.max() > max_blocks * block_size:
        raise ValueError(
            f"seq_lens must be in [0, {max_blocks * block_size}] (the block table's {max_blocks} pages of "
            f"{block_size} tokens), got {seq_lens.tolist()}"
        )
    ids = block_table[: seq_lens.shape[0]]
    used = torch.arange(max_blocks) < ((seq_lens.long() + block_size - 1) // block_size)[:, None]
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bad.any():
        row, page = bad.nonzero()[0].tolist()
        raise ValueError(
            f"block_table[{row}, {page}] = {ids[row, page].item()} is not a block of the cache (0 .. {num_blocks - 1})"
        )


@functools.lru_cache(maxsize=None)
def is_hopper_or_newer(device: torch.device) -> bool:
    """Compiled kernels on an sm_90+ GPU, which have programmatic dependent launch (a kernel may start
    while the one before it finishes) and TMA copies (Triton's tensor descriptors)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a few, under the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
