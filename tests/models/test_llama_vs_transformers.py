"""The whole model against Hugging Face `transformers` on the same weights (fp32)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.models.loader import PRESETS, weight_bytes
from tests.conftest import write_hf_llama

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "dynamic-rope-head_dim-80": dict(
        num_key_value_heads=1, head_dim=80, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
    "biases-head_dim-32": dict(attention_bias=True, mlp_bias=True, head_dim=32, num_key_value_heads=2),
    "llama3-rope-tied": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=64,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen3: per-head q_norm / k_norm (drawn by write_hf_llama) before RoPE; head_dim 24 != 64 / 4.
    "qwen3-gqa-head_dim-24": dict(family="Qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}


def hf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path: Path, name: str) -> None:
    path = write_hf_llama(tmp_path / name, **CONFIGS[name])
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    prompts = [[5, 9, 17, 3, 44, 101, 7], list(range(3, 40)), [11]]
    # All prompts in one batch: one forward pass through the engine's own machinery.
    captured: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: captured.append(e.result.logits.clone()))
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
    ours = captured[0]
    ref = hf_model(path)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert (ours - expected).abs().max().item() <= 1e-4


def _hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    ref = hf_model(path)
    outputs = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(
                torch.tensor([p]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
            outputs.append(out[0, len(p) :].tolist())
    return outputs


PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([1, 5, 12, 17, 33, 48, 64, 90])]


@pytest.mark.parametrize("name", ["gqa", "mqa", "qwen3-gqa-head_dim-24"])
def test_greedy_generate_matches_transformers(tmp_path: Path, name: str) -> None:
    path = write_hf_llama(tmp_path / name, **CONFIGS[name])
    expected = _hf_greedy(path, PROMPTS, max_tokens=12)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats.num_preemptions == 0


def test_greedy_matches_transformers_under_preemption(tmp_path: Path) -> None:
    path = write_hf_llama(tmp_path / "gqa", **CONFIGS["gqa"])
    expected = _hf_greedy(path, PROMPTS, max_tokens=12)
    # 103 tokens at most per request -> 13 blocks of 8; 16 usable blocks cannot hold two long ones.
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=17, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.kv_cache_manager.num_free_blocks() == 16  # every block came back


def test_sliding_window_matches_transformers_mistral(tmp_path: Path) -> None:
    """A Mistral directory (Llama weights + a sliding window on every layer) against transformers."""
    write_hf_llama(tmp_path / "mistral", family="Mistral", sliding_window=8)
    ref = transformers.MistralForCausalLM.from_pretrained(tmp_path / "mistral", dtype=torch.float32).eval()
    prompt = PROMPTS[5]  # 48 tokens: far longer than the window
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    llm = LLM(str(tmp_path / "mistral"), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    assert llm.runner.attn_layers["model.layers.0.self_attn.attn"].sliding_window == 8
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected[0, len(prompt) :].tolist()


def assert_last_logits_match(llm: LLM, ref: torch.nn.Module, prompt: list[int]) -> None:
    """The engine's logits after the whole prompt equal transformers' (fp32, <= 1e-4)."""
    logits: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: logits.append(e.result.logits[0].clone()))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - expected).abs().max().item() <= 1e-4


def test_qwen2_directory_matches_transformers(tmp_path: Path) -> None:
    """Qwen2 = Llama + q/k/v biases: the loader maps it onto the same model file."""
    write_hf_llama(tmp_path / "qwen2", family="Qwen2")
    ref = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "qwen2", dtype=torch.float32).eval()
    prompt = PROMPTS[4]
    llm = LLM(str(tmp_path / "qwen2"), device="cpu", num_kv_blocks=32)
    assert_last_logits_match(llm, ref, prompt)


def _without(*keys: str):
    """A config.json edit that deletes `keys`, as a transformers-4 save would not have written them."""

    def edit(hf: dict) -> None:
        for key in keys:
            del hf[key]

    return edit


def _setting(**values: object):
    """A config.json edit that sets `values` (fields transformers would not write that way itself)."""
    return lambda hf: hf.update(values)


SLIDING = "sliding_attention"
FULL = "full_attention"

# name -> (transformers class prefix, config fields, config.json edit, window of each of the 4 layers)
WINDOW_CASES = {
    # transformers 4 wrote no layer_types: full attention below max_window_layers, windows from there.
    "qwen2-no-layer_types": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        _without("layer_types"),
        [None, 8, 8, 8],
    ),
    # layer_types, when present, decide (here against what max_window_layers would say).
    "qwen2-layer_types": (
        "Qwen2",
        dict(
            use_sliding_window=True, sliding_window=8, max_window_layers=3, layer_types=[SLIDING, FULL, SLIDING, FULL]
        ),
        None,
        [8, None, 8, None],
    ),
    # use_sliding_window false switches every window off, whatever sliding_window and max_window_layers say.
    "qwen2-window-off": (
        "Qwen2",
        dict(use_sliding_window=False, max_window_layers=0),
        lambda hf: (hf.update(sliding_window=8), hf.pop("layer_types")),
        [None] * 4,
    ),
    # Qwen2.5-style config without use_sliding_window: transformers' default is False.
    "qwen2-no-use_sliding_window": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
        _without("use_sliding_window", "layer_types"),
        [None] * 4,
    ),
    # Mistral puts its window on every layer; with layer_types, AutoModel reads it as Ministral: per layer.
    "mistral": ("Mistral", dict(sliding_window=8), None, [8] * 4),
    "mistral-layer_types": (
        "Mistral",
        dict(sliding_window=8),
        _setting(layer_types=[FULL, SLIDING] * 2),
        [None, 8, None, 8],
    ),
    # Qwen2 with use_sliding_window but neither layer_types nor max_window_layers: transformers'
    # default max_window_layers is 28, so a 4-layer model has no windowed layer.
    "qwen2-default-max_window_layers": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        _without("max_window_layers", "layer_types"),
        [None] * 4,
    ),
    # Llama has no window at all, whatever its config.json says (Qwen2's keys included).
    "llama-window-ignored": ("Llama", {}, _setting(sliding_window=8, layer_types=[SLIDING] * 4), [None] * 4),
    "llama-use_sliding_window-ignored": (
        "Llama",
        {},
        _setting(use_sliding_window=True, sliding_window=8, max_window_layers=0),
        [None] * 4,
    ),
    # Qwen3 reads its windows as Qwen2 does.
    "qwen3-no-layer_types": (
        "Qwen3",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
        _without("layer_types"),
        [None, None, 8, 8],
    ),
    "qwen3-layer_types": (
        "Qwen3",
        dict(
            use_sliding_window=True, sliding_window=8, max_window_layers=3, layer_types=[FULL, SLIDING, SLIDING, FULL]
        ),
        None,
        [None, 8, 8, None],
    ),
    "qwen3-no-use_sliding_window": (
        "Qwen3",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
        _without("use_sliding_window", "layer_types"),
        [None] * 4,
    ),
}


def _family_dir(path: Path, family: str, fields: dict, edit: Callable[[dict], object] | None) -> Path:
    """A 4-layer `{family}ForCausalLM` written by `write_hf_llama`, its config.json then edited."""
    write_hf_llama(path, family=family, **{"num_hidden_layers": 4, **fields})
    if edit is not None:
        hf = json.loads((path / "config.json").read_text())
        edit(hf)
        (path / "config.json").write_text(json.dumps(hf))
    return path


def _logits_match_auto_model(path: Path, prompt: list[int]) -> LLM:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_last_logits_match(llm, ref, prompt)
    return llm


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_per_layer_windows_match_transformers(tmp_path: Path, name: str) -> None:
    """Each family's config.json -> per-layer windows, read as transformers reads them (prompt 48 > window 8)."""
    family, fields, edit, windows = WINDOW_CASES[name]
    llm = _logits_match_auto_model(_family_dir(tmp_path / name, family, fields, edit), PROMPTS[5])
    assert [llm.runner.attn_layers[f"model.layers.{i}.self_attn.attn"].sliding_window for i in range(4)] == windows


def _no_context_lengths(hf: dict) -> None:
    """No max_position_embeddings, and a RoPE scaling that takes its pretraining length from it."""
    del hf["max_position_embeddings"]
    del hf["rope_parameters"]["original_max_position_embeddings"]


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

# name -> (family, config fields, config.json edit): keys a family reads its own way in transformers.
FAMILY_KEY_CASES = {
    # Left out, max_position_embeddings is the family's default (Mistral 131072, Qwen2 32768), not Llama's 2048.
    "mistral-default-context": ("Mistral", dict(rope_parameters=LLAMA3, sliding_window=None), _no_context_lengths),
    "qwen2-default-context": ("Qwen2", dict(rope_parameters=LLAMA3), _no_context_lengths),
    # Mistral has no biases and Qwen2 biases on q/k/v only: bias keys in their files change nothing.
    "mistral-bias-keys": ("Mistral", dict(sliding_window=None), _setting(attention_bias=True, mlp_bias=True)),
    "qwen2-bias-keys": ("Qwen2", {}, _setting(attention_bias=True, mlp_bias=True)),
    "llama-qkv_bias-key": ("Llama", {}, _setting(qkv_bias=True)),  # not a Llama key
    "llama-swish": ("Llama", {}, _setting(hidden_act="swish")),  # another name of SiLU
    # Qwen3's defaults: max_position_embeddings 32768, head_dim 128 (not 64 / 4), 32 KV heads.
    "qwen3-default-context": ("Qwen3", dict(rope_parameters=LLAMA3), _no_context_lengths),
    "qwen3-default-head_dim": ("Qwen3", {}, _without("head_dim")),
    "qwen3-default-num_key_value_heads": (
        "Qwen3",
        dict(num_attention_heads=32, num_key_value_heads=32, head_dim=8),
        _without("num_key_value_heads"),
    ),
    # attention_bias puts biases on q/k/v and o_proj (as Llama's); the MLP has none, whatever mlp_bias says.
    "qwen3-bias-keys": ("Qwen3", dict(attention_bias=True), _setting(mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(FAMILY_KEY_CASES))
def test_family_keys_are_read_as_transformers_reads_them(tmp_path: Path, name: str) -> None:
    family, fields, edit = FAMILY_KEY_CASES[name]
    _logits_match_auto_model(_family_dir(tmp_path / name, family, fields, edit), PROMPTS[5])


@pytest.mark.parametrize(("preset", "billions", "non_embedding"), [("qwen3-0.6b", 0.6, 0.44), ("qwen3-8b", 8.2, 6.95)])
def test_qwen3_presets_have_the_model_cards_parameter_counts(
    preset: str, billions: float, non_embedding: float
) -> None:
    """The benchmark presets are the real models' shapes: counted on the meta device, the parameters
    (tied embeddings once) are what Qwen3-0.6B's and Qwen3-8B's model cards say, total and without
    the embeddings."""
    config = PRESETS[preset]
    _, params = weight_bytes(config)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert (round(params / 1e9, 1), round((params - embeddings) / 1e9, 2)) == (billions, non_embedding)


def test_old_checkpoint_with_rotary_inv_freq_buffers_loads(tmp_path: Path) -> None:
    """checkpoints converted by older transformers store each layer's RoPE buffer
    `self_attn.rotary_emb.inv_freq`; it is derived from config.json, so it is skipped, not an error."""
    from safetensors.torch import load_file, save_file

    model_dir = write_hf_llama(tmp_path / "old")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    head_dim = 64 // 4
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 10000.0 ** -(
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        )
    save_file(tensors, str(path), metadata={"format": "pt"})
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32)
    assert_last_logits_match(llm, reference, [5, 9, 17, 3, 44, 101, 7])


def test_mistral_without_sliding_window_key_has_transformers_default_window(tmp_path: Path) -> None:
    """a Mistral config.json without `sliding_window` has transformers' default 4096 on
    every layer (MistralConfig's default), not no window."""

    path = _family_dir(tmp_path / "mistral", "Mistral", dict(sliding_window=8), _without("sliding_window"))
    reference = transformers.AutoConfig.from_pretrained(path)
    assert reference.sliding_window == 4096
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    assert [llm.runner.attn_layers[f"model.layers.{i}.self_attn.attn"].sliding_window for i in range(4)] == [
        reference.sliding_window
    ] * 4
