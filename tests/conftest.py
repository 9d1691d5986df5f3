"""Shared fixtures: tiny Hugging Face Llama directories written by `transformers` itself.

Without a GPU the Triton kernels are tested in Triton's interpreter, which Triton picks only if
TRITON_INTERPRET=1 is set when it is first imported: set it here, before any test module imports
triton (`.ci/test` exports it too). With a GPU the kernels are tested compiled.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def write_hf_llama(path: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Save a randomly initialised `transformers.LlamaForCausalLM` with `save_pretrained`."""
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # A wide init makes logits peaked, so greedy argmax is far from ties.
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture
def hf_llama_dir(tmp_path: Path) -> Path:
    return write_hf_llama(tmp_path / "llama")
