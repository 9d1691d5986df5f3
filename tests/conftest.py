"""Shared fixtures: tiny Hugging Face Llama / Qwen3 / DeepSeek directories written by `transformers` itself.

Without a GPU the Triton kernels are tested in Triton's interpreter, which Triton picks only if
TRITON_INTERPRET=1 is set when it is first imported: set it here, before any test module imports
triton (`.ci/test` exports it too). With a GPU the kernels are tested compiled.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def needs_triton_on_cpu(what: str) -> pytest.MarkDecorator:
    """Skip marker for tests that give Triton kernels CPU tensors: they need its interpreter, on and
    working here (`interpreter_problem` says why not: e.g. TRITON_INTERPRET unset on a GPU machine)."""
    try:
        from pagedkv.kernels import interpreter_problem

        problem = interpreter_problem()
    except ImportError as exc:  # no triton package
        problem = str(exc)
    return pytest.mark.skipif(problem is not None, reason=f"{what} on CPU tensors: {problem}")


def smoke_run(script: str, json_out: Path, *args: str) -> dict:
    """`python benchmarks/<script> --smoke --json <json_out> *args` from the repository root (a
    benchmark's whole path on the CPU); its JSON. A failed run fails with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke", "--json", str(json_out), *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {"stdout": done.stdout, **json.loads(json_out.read_text())}


@pytest.fixture(autouse=True)
def fresh_tries() -> None:
    """Every test starts with no wrong tries counted and nothing to reveal, whatever ran before it.

    Only where pagedkv.exercises is imported: before that, its registry is fresh anyway (and the other tests
    need not import it)."""
    exercises = sys.modules.get("pagedkv.exercises")
    if exercises is not None:
        exercises.forget_tries()


def edit_config_json(model_dir: Path, **changes: object) -> None:
    """Set (or, with None, delete) keys of the directory's config.json."""
    path = model_dir / "config.json"
    hf = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    path.write_text(json.dumps(hf))


def write_hf_llama(path: Path, *, family: str = "Llama", seed: int = 0, **overrides: object) -> Path:
    """Save a randomly initialised `transformers.{family}ForCausalLM` (Llama, Mistral, Qwen2, Qwen3) with `save_pretrained`.

    Qwen3's per-head `q_norm` / `k_norm` weights are drawn around 1 (transformers sets them to 1):
    with ones, a model that swapped the two norms, or gave k the q norm, would compute the same.
    """
    transformers = pytest.importorskip("transformers")
    # A wide init (initializer_range) makes logits peaked, so greedy argmax is far from ties.
    # fmt: off
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, max_position_embeddings=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    # fmt: on
    fields.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**fields)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1 + 0.5 * torch.randn(param.shape))
    model.save_pretrained(path)
    return path


def write_hf_deepseek(path: Path, *, version: int = 2, seed: int = 0, **overrides: object) -> Path:
    """Save a seeded `transformers.DeepseekV2ForCausalLM` (version 2) or `DeepseekV3ForCausalLM` (3).

    Three layers, the first dense and two MoE (4 routed experts, top 2, one shared). The weights
    are drawn like the tiny presets' (`init_preset_weights`): attention 2 / sqrt(fan_in), MLPs and
    the router 1 / sqrt(fan_in), embeddings 0.5, so attention and routing decide the logits. V3's
    `e_score_correction_bias` is drawn too (std 0.3, sigmoid scores are in (0, 1)): a model that
    ignores it, or weighs experts by it, routes differently.
    """
    transformers = pytest.importorskip("transformers")
    # fmt: off
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, max_position_embeddings=512,
        num_hidden_layers=3, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    # fmt: on
    fields.update(copy.deepcopy(overrides))  # transformers writes into the rope_scaling dict it is given
    config_cls, model_cls = (
        (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
        if version == 2
        else (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
    )
    model = model_cls(config_cls(**fields)).eval()
    generator = torch.Generator().manual_seed(seed)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in tensors.items():
        if "norm" in name or "rotary_emb" in name or tensor.numel() == 0:  # empty: n_shared_experts=0
            continue
        if "e_score_correction_bias" in name:
            std = 0.3
        elif "embed_tokens" in name or "lm_head" in name:
            std = 0.5
        else:  # [.., out, in]: expert weights are stacked [experts, out, in]
            std = (2.0 if ".self_attn." in name else 1.0) / tensor.shape[-1] ** 0.5
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    model.save_pretrained(path)
    return path


@pytest.fixture
def hf_llama_dir(tmp_path: Path) -> Path:
    return write_hf_llama(tmp_path / "llama")


def step_through_interrupts(llm: Any) -> tuple[dict[str, list[int]], int]:
    """Step until done, calling step() again after each KeyboardInterrupt: each request's final
    tokens, and how many interrupts there were."""
    final, interrupts = {}, 0
    while llm.has_unfinished_requests():
        try:
            outputs = llm.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        final.update({out.request_id: out.outputs[0].token_ids for out in outputs if out.finished})
    return final, interrupts
