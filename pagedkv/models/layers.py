"""Building blocks of the models: RMSNorm, rotary embedding (+ its scalings), SwiGLU, head layout."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedkv import batch_invariant
from pagedkv.config import get_current_engine_config


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The batch-invariant mode reduces each row on its own, in one order (pagedkv/batch_invariant.py).
        invariant = get_current_engine_config().model_config.batch_invariant
        self.norm = batch_invariant.rms_norm if invariant else batch_invariant.rms_norm_reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's type: `rope_type` (transformers 5), or `type` (older config.json files)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for positions stretched `factor` times: 1 + 0.1 * mscale * ln(factor)."""
    return 1.0 if factor <= 1 else 1.0 + 0.1 * mscale * math.log(factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3, YaRN or linear scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = rope_type(scaling)
    if kind in ("default", "dynamic"):
        # Dynamic NTK scaling only changes the frequencies for sequences longer than the
        # model's max_position_embeddings, which the engine never runs (max_model_len is capped).
        return inv_freq.float()
    assert scaling is not None
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
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
    if kind == "yarn":
        # The same idea counted per dimension pair, in rotations over the original context:
        # pairs turning more than beta_fast times keep their frequency, pairs turning fewer than
        # beta_slow times are slowed down by `factor`, and a linear ramp blends the pairs between.
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def pair_turning(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times
            return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_turning(beta_fast), pair_turning(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        slowed = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0.0, 1.0)
        return (slowed * inv_freq / factor + (1 - slowed) * inv_freq).float()
    raise NotImplementedError(
        f"RoPE scaling type {kind!r} is not supported; supported: 'default', 'linear', 'dynamic', 'llama3', 'yarn'."
    )


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, 1 for the other types.

    Scaling both q and k by it multiplies their dot products by its square, sharpening attention
    that the slowed-down frequencies would otherwise flatten. DeepSeek's configs set `mscale` and
    `mscale_all_dim` equal, which makes it 1 (DeepSeek scales the softmax instead).
    """
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, in pairs of dimensions.

    The pairs are the two halves, (x_i, x_{i + d/2}) ("rotate half", Hugging Face Llama), or with
    `interleaved` neighbours, (x_0, x_1), (x_2, x_3), ... (DeepSeek, GPT-J); rotated pairs stay where
    they were. cos and sin carry the scaling's attention factor (YaRN; 1 otherwise).
    """

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.head_dim, self.interleaved = head_dim, interleaved
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(scaling)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [tokens, head_dim / 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.view(shape[0], -1, self.head_dim).float()
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleaved else x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = torch.stack([r1, r2], dim=-1).flatten(-2) if self.interleaved else torch.cat([r1, r2], dim=-1)
        return rotated.to(dtype).view(shape)


_SHARED_ROPE: dict[tuple[Any, ...], RotaryEmbedding] | None = None


@contextlib.contextmanager
def share_rotary_embeddings() -> Iterator[None]:
    """Inside the block, `get_rope` hands every layer asking for the same rotation the same module.

    A model's layers all rotate alike, and one cos/sin table is max_position x head_dim floats
    (Llama-3-8B: 67 MB), so 32 copies would take GBs of GPU memory from the KV cache. The sharing
    is scoped to building one model: two models in one process (float32 and bfloat16, say) never
    share a table that `.to(dtype)` would convert under the other's feet.
    """
    global _SHARED_ROPE
    saved, _SHARED_ROPE = _SHARED_ROPE, {}
    try:
        yield
    finally:
        _SHARED_ROPE = saved


def get_rope(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, interleaved: bool = False
) -> RotaryEmbedding:
    """A `RotaryEmbedding`: a new one, or inside `share_rotary_embeddings` the model's shared one."""
    if _SHARED_ROPE is None:
        return RotaryEmbedding(head_dim, max_position, theta, scaling, interleaved)
    key = (head_dim, max_position, theta, repr(sorted((scaling or {}).items())), interleaved)
    if key not in _SHARED_ROPE:
        _SHARED_ROPE[key] = RotaryEmbedding(head_dim, max_position, theta, scaling, interleaved)
    return _SHARED_ROPE[key]


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
            raise ValueError(f"num_key_value_heads ({total_num_kv_heads}) must be divisible by tp_size ({tp_size}).")
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
    return (
        range(rank * layout.num_heads, (rank + 1) * layout.num_heads),
        range(first_kv, first_kv + layout.num_kv_heads),
    )
