"""Model building blocks by hand and against transformers: the cases whole-model logits miss
(an eps that every test config sets to the same value, bf16 rounding with weights that are not 1,
where a rotated pair is stored)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import pagedkv.models
from pagedkv.models.layers import RMSNorm, RotaryEmbedding


def test_rms_norm_uses_its_own_eps() -> None:
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    torch.testing.assert_close(RMSNorm(2, eps=0.5)(x), x / math.sqrt(12.5 + 0.5))


def test_rms_norm_in_bfloat16_rounds_as_transformers_does() -> None:
    """transformers casts the normalised x back to bf16 before the weight multiplies it: bit for bit."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    weight = (1 + 0.3 * torch.randn(256, generator=gen)).bfloat16()
    x = torch.randn(64, 256, generator=gen).bfloat16()
    ours, theirs = RMSNorm(256, 1e-6).bfloat16(), LlamaRMSNorm(256, 1e-6).bfloat16()
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize(
    "interleaved, expected",
    [
        (True, [math.cos(1), math.sin(1), 0.0, 0.0]),  # pair (x0, x1) turns in place
        (False, [math.cos(1), 0.0, math.sin(1), 0.0]),  # pair (x0, x2): the two halves
    ],
)
def test_rope_keeps_each_rotated_pair_where_it_was(interleaved: bool, expected: list[float]) -> None:
    """head_dim 4, position 1: the first pair's frequency is theta^0 = 1, so x = e0 turns by 1 rad.
    Equal permutations of q and k leave q.k alone; the cached k_pe layout must still be DeepSeek's."""
    rope = RotaryEmbedding(4, 4, 10000.0, None, interleaved=interleaved)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    q, k = rope(torch.tensor([1]), x, x.clone())
    torch.testing.assert_close(q, torch.tensor([expected]))
    torch.testing.assert_close(k, torch.tensor([expected]))


@pytest.mark.parametrize(
    "name, first", [("llama", "LlamaAttention"), ("qwen3", "Qwen3Attention"), ("deepseek_v2", "DeepseekV2Attention")]
)
def test_model_file_starts_at_its_attention_class(name: str, first: str) -> None:
    """Notebook 01 reads the model files: after the docstring and imports each one opens with its
    attention module; the config.json dataclasses and their defaults are in pagedkv/models/configs.py."""
    path = Path(pagedkv.models.__file__).parent / f"{name}.py"
    body = [
        node
        for node in ast.parse(path.read_text()).body
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr))
    ]  # Expr: the docstring
    assert isinstance(body[0], ast.ClassDef) and body[0].name == first, (
        f"{path.name} opens with {ast.unparse(body[0]).splitlines()[0]!r}, not class {first}"
    )
