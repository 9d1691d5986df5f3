"""The routed experts of a mixture-of-experts layer, stacked into two weights (vLLM's FusedMoE layout).

A checkpoint stores each expert as its own SwiGLU MLP (gate_proj, up_proj, down_proj). Run one
after another, a layer of 64 experts is ~320 small kernels per step. Stacked,

    w13_weight [E, 2I, H]: expert e's gate rows, then its up rows ("w1" and "w3" in vLLM's names)
    w2_weight  [E, H, I]:  expert e's down_proj ("w2")

the layer is a few large operations, in one of two ways:

grouped (each token through its own top_k experts, by `torch._grouped_mm` where the device and
dtype have it: `grouped_mm_supported`): sort the token x expert assignments by expert, and
multiply each expert's run of rows by that expert's matrices in one call. The group sizes stay
on the device (no host sync), so a decode step is still captured in a CUDA graph.

    assignments (t, e) sorted by e:  | e=0: t3 t7 | e=1: t0 | e=2: (none) | e=3: t0 t3 t5 | ...
    rows x[t] ── grouped @ w13[e]ᵀ ── silu(gate) * up ── grouped @ w2[e]ᵀ ── * weight ── add into out[t]

dense (the fallback): every expert on every token, with router weight 0 where the token was not
routed, as two matmuls over all experts (E / top_k times the FLOPs of the grouped way):

    x [T, H] ── x @ w13ᵀ ──> [T, E, 2, I] ── silu(gate) * up * combine[t, e] ──> per expert @ w2[e]ᵀ, summed
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.config import get_current_engine_config
from pagedkv.forward_context import register_layer
from pagedkv.models.layers import SiluAndMul
from pagedkv.models.parallel_layers import ShardId, copy_checked, set_weight_attrs

CHUNK_ELEMENTS = 2**25
"""The dense way runs tokens in chunks whose [tokens, E, 2I] intermediate holds at most this many
values (64 MB in bf16), so a long prefill does not need E times the activations of one MLP."""


def expert_params_mapping(num_experts: int) -> dict[str, tuple[str, ShardId]]:
    """`load_hf_weights`' `stacked` entries routing Hugging Face expert tensors into `FusedMoE`:
    "...experts.3.up_proj.weight" -> parameter "...experts.w13_weight", shard (3, "w3")."""
    return {
        f".experts.{e}.{hf}.": (f".experts.{param}_", (e, shard))
        for e in range(num_experts)
        for hf, param, shard in (("gate_proj", "w13", "w1"), ("up_proj", "w13", "w3"), ("down_proj", "w2", "w2"))
    }


def _tiny_grouped_mm(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Two groups (rows 0 and 1-2) of ones through `torch._grouped_mm`: every output value is 16."""
    a = torch.ones(3, 16, device=device, dtype=dtype)
    b = torch.ones(2, 32, 16, device=device, dtype=dtype).transpose(1, 2)
    return torch._grouped_mm(a, b, offs=torch.tensor([1, 3], device=device, dtype=torch.int32))


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` (a private op) serves `dtype` on `device` with the group offsets
    read on the device. On CUDA that is its CUTLASS kernel (bf16, Hopper or newer): for other dtypes
    it falls back to a loop that reads the offsets on the host, which a CUDA graph would freeze at
    their capture-time values. The CPU has no graphs: any dtype it runs, tried once on tiny inputs."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (9, 0)):
        return False
    try:
        return bool((_tiny_grouped_mm(device, dtype) == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def grouped_mm_traceable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.compile can trace `torch._grouped_mm` for `dtype`. It runs the op's shape
    function on fake tensors instead of the kernel, and that function may take fewer dtypes than
    the kernel does (bf16 only in torch 2.13, where the CPU kernel also takes float32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # it logs a refusal as an error
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode():
            _tiny_grouped_mm(device, dtype)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    finally:
        fake_log.setLevel(level)


class FusedMoE(nn.Module):
    """All routed experts of one layer in two stacked weights; `forward` runs each token's experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
        if get_current_engine_config().model_config.batch_invariant:
            # Each expert's matmul has as many rows as tokens routed to it, which the batch decides.
            raise NotImplementedError(
                "batch_invariant=True: FusedMoE layers (mixture-of-experts models) have no batch-invariant "
                "path here; use a dense model (llama, qwen3, tiny, tiny-pydoc) or batch_invariant=False."
            )
        self.act_fn = SiluAndMul()  # on each expert's [gate | up] rows, as in LlamaMLP
        self.use_grouped_mm = False
        """Set by `process_weights_after_loading` from the weights' device and dtype."""
        self.grouped_mm_traceable = False
        """Whether torch.compile can trace the grouped way too (set with `use_grouped_mm`)."""
        if prefix:
            # Registered by name, last (once built), as attention layers are (vLLM's FusedMoE,
            # vllm/model_executor/layers/fused_moe/layer.py): runners and compilers find it with
            # `get_layers_from_config(config, FusedMoE)`. Stand-alone experts (no prefix, as in tests) register nowhere.
            register_layer(get_current_engine_config(), prefix, self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy one expert's gate_proj ("w1"), up_proj ("w3") or down_proj ("w2") into its slot."""
        if not (isinstance(shard_id, tuple) and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(
                f"FusedMoE loads one expert at a time: shard (expert < {self.num_experts}, "
                f"'w1' | 'w3' | 'w2'), got {shard_id!r}"
            )
        expert, which = shard_id
        target = param.data[expert]
        if which != "w2":  # gate rows first, then up rows
            target = target.narrow(0, 0 if which == "w1" else self.intermediate_size, self.intermediate_size)
        copy_checked(target, loaded, f"expert {expert} {which}")

    def process_weights_after_loading(self) -> None:
        """Pick the grouped way where this device and dtype run it (checked here, never during a capture)
        and its rows are 16-byte multiples, which `torch._grouped_mm` requires of every stride."""
        w = self.w13_weight
        aligned = all(size * w.element_size() % 16 == 0 for size in (w.shape[2], self.intermediate_size))
        self.use_grouped_mm = aligned and grouped_mm_supported(w.device, w.dtype)
        self.grouped_mm_traceable = self.use_grouped_mm and grouped_mm_traceable(w.device, w.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; the router's weights and expert ids [tokens, top_k] -> [tokens, hidden].

        Under torch.compile (`LLM(compile=True)`) the grouped way is traced only where its shape
        function takes the dtype; elsewhere the traced model takes the dense way."""
        tracing = torch.compiler.is_compiling()
        grouped = self.use_grouped_mm and (self.grouped_mm_traceable or not tracing)
        return self._grouped(x, weights, ids) if grouped else self._dense(x, weights, ids)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[1]
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)  # assignment numbers, grouped by expert
        token = order // top_k
        # Rows per expert, counted on the device (torch.bincount would read its size on the host).
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)  # group e is rows [ends[e-1], ends[e])
        gate_up = torch._grouped_mm(x[token], self.w13_weight.transpose(1, 2), offs=ends)  # [assignments, 2I]
        y = torch._grouped_mm(self.act_fn(gate_up), self.w2_weight.transpose(1, 2), offs=ends)
        y = y.float() * weights.flatten()[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        experts, two_i = self.w13_weight.shape[:2]
        # [tokens, E]: a token's weight for each expert, 0 where it was not routed.
        combine = weights.new_zeros(x.shape[0], experts).scatter_(1, ids, weights)
        if torch.compiler.is_compiling():  # one graph for every batch size: no loop over its chunks
            return self._dense_rows(x, combine)
        out = torch.empty_like(x)
        step = max(1, CHUNK_ELEMENTS // (experts * two_i))
        for start in range(0, x.shape[0], step):  # host-side sizes only: the same chunks at capture and replay
            chunk = slice(start, start + step)
            out[chunk] = self._dense_rows(x[chunk], combine[chunk])
        return out

    def _dense_rows(self, x: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """Every expert on every row of `x`, each weighted by `combine` [rows, E] and summed."""
        experts, two_i, hidden = self.w13_weight.shape
        w2_t = self.w2_weight.transpose(1, 2)  # [E, I, H] as a view: bmm reads it transposed
        gate_up = F.linear(x, self.w13_weight.view(experts * two_i, hidden)).view(-1, experts, two_i)  # [rows, E, 2I]
        act = self.act_fn(gate_up) * combine[:, :, None].to(x.dtype)  # [rows, E, I]
        return torch.bmm(act.transpose(0, 1), w2_t).sum(0)  # [E, rows, H] summed over experts

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.w13_weight.shape[2]}, intermediate={self.intermediate_size}, "
            f"grouped_mm={self.use_grouped_mm}"
        )
