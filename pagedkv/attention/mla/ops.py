"""The two MLA custom ops: `unified_mla_kv_cache_update` and `unified_mla_attention_with_output`.

They do what the MHA ops do (pagedkv/attention/ops.py), with MLA's inputs: the new tokens'
latents and rope keys instead of K and V. Both resolve the layer, its cache, metadata and
slot mapping by name in the forward context, so torch.compile sees one opaque node each and
can split the graph there.
"""

from __future__ import annotations

import torch

from pagedkv.attention.ops import attention_with_output, kv_cache_update, register_op


def _mla_kv_cache_update(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, layer_name: str) -> torch.Tensor:
    return kv_cache_update(kv_c_normed, k_pe, layer_name)


def _mla_kv_cache_update_fake(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty(0, device=kv_c_normed.device, dtype=kv_c_normed.dtype)


def _mla_attention_with_output(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    attention_with_output(q, kv_c_normed, k_pe, output, layer_name)


def _mla_attention_fake(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    return None


register_op("unified_mla_kv_cache_update", _mla_kv_cache_update, _mla_kv_cache_update_fake, mutates_args=())
register_op(
    "unified_mla_attention_with_output", _mla_attention_with_output, _mla_attention_fake, mutates_args=("output",)
)
