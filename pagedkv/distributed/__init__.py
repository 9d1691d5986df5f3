"""Tensor parallelism: this process's rank in the group, and the collectives the parallel layers use."""

from pagedkv.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    single_rank,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "destroy_tensor_parallel",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "single_rank",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
