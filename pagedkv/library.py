"""The `pagedkv` torch library: functions that torch.compile sees as one opaque node each.

An op's fake implementation gives the compiler its output's shape and dtype without running it,
so the compiler can trace through the call and split or fuse around it, but never looks inside:
the attention ops (pagedkv/attention/ops.py) and the batch-invariant matmul and RMSNorm
(pagedkv/batch_invariant.py), whose kernels must stay the ones written here.

Ops are registered straight into a `torch.library.Library`, not with the
`@torch.library.custom_op` decorator: the decorator's Python wrapper costs ~15-20 us per call,
while a plain registration goes through the C++ dispatcher in a few us (vLLM's
`direct_register_custom_op` does the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIBRARY = torch.library.Library("pagedkv", "FRAGMENT")


def register_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
    """Define `torch.ops.pagedkv.<name>` with the schema read off `impl`'s type hints."""
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=mutates_args))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedkv::{name}", fake, lib=_LIBRARY)
