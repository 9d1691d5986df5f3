"""Building blocks of a Llama-family model: RMSNorm, rotary embedding, SwiGLU, head layout."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK scaling only changes the frequencies for sequences longer than the
        # model's max_position_embeddings, which the engine never runs (max_model_len is capped).
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
        # and the band in between is blended linearly in "how many wavelengths fit".
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        waves_in_context = old_len / wavelen
        blend = ((waves_in_context - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
        return scaled.float()
    raise NotImplementedError(
        f"RoPE scaling type {rope_type!r} is not supported; supported: 'default', 'linear', 'dynamic', 'llama3'."
    )


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (the "rotate half" layout of Hugging Face Llama)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [tokens, head_dim / 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x1, x2 = x.view(shape[0], -1, self.head_dim).float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated.to(dtype).view(shape)


class SiluAndMul(nn.Module):
    """SwiGLU activation: silu(gate) * up, on the fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


@dataclass(frozen=True)
class HeadLayout:
    """How attention heads land on one tensor-parallel rank."""

    tp_size: int
    num_heads: int
    """Query heads per rank (always partitioned)."""
    num_kv_heads: int
    """KV heads per rank: partitioned when there are at least tp_size of them, else replicated."""
    kv_head_replicas: int
    """How many ranks hold a copy of each KV head (1 = partitioned)."""


def head_layout(total_num_heads: int, total_num_kv_heads: int, tp_size: int = 1) -> HeadLayout:
    """Per-rank head counts for MHA / GQA / MQA under tensor parallelism of `tp_size`."""
    if total_num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({total_num_heads}) must be divisible by tp_size ({tp_size}).")
    if total_num_kv_heads >= tp_size:
        if total_num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({total_num_kv_heads}) must be divisible by tp_size ({tp_size})."
            )
        return HeadLayout(tp_size, total_num_heads // tp_size, total_num_kv_heads // tp_size, 1)
    if tp_size % total_num_kv_heads:
        raise ValueError(
            f"tp_size ({tp_size}) must be divisible by num_key_value_heads ({total_num_kv_heads}) "
            "when KV heads are replicated."
        )
    return HeadLayout(tp_size, total_num_heads // tp_size, 1, tp_size // total_num_kv_heads)


def rank_heads(layout: HeadLayout, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) that rank `rank` holds, as global head indices.

    Query heads are consecutive blocks. With replicated KV heads, ranks r * replicas ...
    (r + 1) * replicas - 1 all hold KV head r: the one their query heads attend to.
    """
    if not 0 <= rank < layout.tp_size:
        raise ValueError(f"rank must be in [0, {layout.tp_size}), got {rank}.")
    first_kv = (rank // layout.kv_head_replicas) * layout.num_kv_heads
    return (range(rank * layout.num_heads, (rank + 1) * layout.num_heads),
            range(first_kv, first_kv + layout.num_kv_heads))
