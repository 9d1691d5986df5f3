"""Model loading and request edges the other tests miss: older checkpoints, config.json keys left to their
defaults, stop ids with ignore_eos, the greedy threshold, and the detokeniser's bounded window."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pagedkv.models
from pagedkv import LLM, SamplingParams
from tests.conftest import write_hf_llama

transformers = pytest.importorskip("transformers")


# ---- model files: the model, its config elsewhere ----------------------------------------

@pytest.mark.parametrize("name, first", [
    ("llama", "LlamaAttention"), ("qwen3", "Qwen3Attention"), ("deepseek_v2", "DeepseekV2Attention")])
def test_model_file_starts_at_its_attention_class(name: str, first: str) -> None:
    """Notebook 01 reads the model files: after the docstring and imports each one opens with its
    attention module; the config.json dataclasses and their defaults are in pagedkv/models/configs.py."""
    path = Path(pagedkv.models.__file__).parent / f"{name}.py"
    body = [node for node in ast.parse(path.read_text()).body
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr))]  # Expr: the docstring
    assert isinstance(body[0], ast.ClassDef) and body[0].name == first, \
        f"{path.name} opens with {ast.unparse(body[0]).splitlines()[0]!r}, not class {first}"


# ---- loader: older checkpoints ----------------------------------------------------------

def test_old_checkpoint_with_rotary_inv_freq_buffers_loads(tmp_path: Path) -> None:
    """checkpoints converted by older transformers store each layer's RoPE buffer
    `self_attn.rotary_emb.inv_freq`; it is derived from config.json, so it is skipped, not an error."""
    from safetensors.torch import load_file, save_file

    from tests.test_llama_vs_transformers import assert_last_logits_match

    model_dir = write_hf_llama(tmp_path / "old")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    head_dim = 64 // 4
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = \
            10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    save_file(tensors, str(path), metadata={"format": "pt"})
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32)
    assert_last_logits_match(llm, reference, [5, 9, 17, 3, 44, 101, 7])


# ---- llama: family defaults for keys a config.json leaves out --------------------------------

def test_mistral_without_sliding_window_key_has_transformers_default_window(tmp_path: Path) -> None:
    """a Mistral config.json without `sliding_window` has transformers' default 4096 on
    every layer (MistralConfig's default), not no window."""
    from tests.test_llama_vs_transformers import _family_dir, _without

    path = _family_dir(tmp_path / "mistral", "Mistral", dict(sliding_window=8), _without("sliding_window"))
    reference = transformers.AutoConfig.from_pretrained(path)
    assert reference.sliding_window == 4096
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    assert [llm.runner.attn_layers[f"model.layers.{i}.self_attn.attn"].sliding_window for i in range(4)] == [
        reference.sliding_window] * 4


# ---- loader: the tiny presets' embedding scale ---------------------------------------------

def test_tiny_preset_logits_spread_as_documented() -> None:
    """`init_preset_weights` draws the tied embedding with std 0.5 so that logits spread
    by about sqrt(hidden) * 0.5 = 4 and greedy choices are rarely near a tie. With HF's 0.02 the
    spread is ~0.16 and the cross-backend greedy comparisons sit on near-ties."""
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
    rows: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: rows.extend(e.result.logits.clone()))
    llm.generate([{"prompt_token_ids": [256, *b"Hello world"]}, {"prompt_token_ids": [256, *b"paged"]}],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    spread = torch.stack(rows).std(dim=-1)
    assert spread.min().item() > 1.5 and spread.max().item() < 12, spread
    embedding = llm.model.model.embed_tokens.weight
    assert abs(embedding.std().item() - 0.5) < 0.05


# ---- request: stop conditions and the greedy threshold --------------------------------------

def _request(**params: object):
    from pagedkv.engine.request import Request
    return Request("r", [1, 2, 3], SamplingParams(**params), eos_token_ids=[9])


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    """ignore_eos only concerns the model's EOS ids; a user's stop_token_ids still stop
    (vLLM checks them regardless of ignore_eos)."""
    req = _request(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    req.append_output_token_id(9)  # EOS, ignored
    assert not req.check_stop(max_model_len=100)
    req.append_output_token_id(7)
    assert req.check_stop(max_model_len=100) and req.finish_reason == "stop"


def test_greedy_threshold_is_strictly_below_sampling_eps() -> None:
    """"anything below SAMPLING_EPS (1e-5)" is greedy; SAMPLING_EPS itself samples (and
    so draws from the request's or the global generator), as vLLM's `temperature < _SAMPLING_EPS`."""
    from pagedkv.engine.request import SAMPLING_EPS

    assert SamplingParams(temperature=SAMPLING_EPS * 0.999).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


# ---- detokenizer: each call decodes only a few recent ids ------------------------------------

def test_detokenizer_decodes_a_bounded_window_per_call() -> None:
    """Each call decodes a few recent ids. A prefix offset that never moves gives the same text,
    but every call decodes the whole output again: O(n^2) per request, what the class avoids."""
    from pagedkv.engine.detokenizer import IncrementalDetokenizer
    from pagedkv.models.tokenizer import ByteTokenizer

    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids):  # type: ignore[override]
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids)

    tokenizer = Counting()
    ids = list(("abc é東😀 " * 40).encode())
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n in range(len(ids)):
        assert detokenizer.text(ids[: n + 1]) == ByteTokenizer().decode(ids[: n + 1])
    assert Counting.longest <= 8  # a 4-byte character pending plus the window's one step back
