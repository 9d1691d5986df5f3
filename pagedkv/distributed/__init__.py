"""Tensor parallelism: an engine's group of ranks, the active one, and the collectives the parallel layers use."""

from pagedkv.distributed.parallel_state import (
    TensorParallelGroup,
    broadcast_object,
    close_tensor_parallel_group,
    get_tp_rank,
    get_tp_size,
    new_tensor_parallel_group,
    single_rank,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_parallel,
)

__all__ = [
    "TensorParallelGroup",
    "broadcast_object",
    "close_tensor_parallel_group",
    "get_tp_rank",
    "get_tp_size",
    "new_tensor_parallel_group",
    "single_rank",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_parallel",
]
