"""Model loading and request edges the other tests miss: non-zero biases under tensor parallelism
(transformers initialises them to zero), older checkpoints, config.json keys left to their
defaults, stop ids with ignore_eos, the greedy threshold, and the detokeniser's bounded window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from tests.conftest import write_hf_llama
from tests.reference import reference_logits

transformers = pytest.importorskip("transformers")


# ---- parallel_layers: biases under tensor parallelism ---------------------------------------

def with_random_biases(model_dir: Path, std: float = 0.3) -> Path:
    """transformers initialises every bias to 0, which hides a bias added tp times: draw them."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * std
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def test_tp2_with_all_biases_matches_tp1_and_transformers(tmp_path: Path) -> None:
    """RowParallelLinear's bias must be added once, after the all-reduce (added
    on every rank before it, it is counted tp times). No tensor-parallel test had a bias."""
    from tests.test_tensor_parallel import assert_no_workers_left, serve

    model_dir = with_random_biases(write_hf_llama(tmp_path / "biases", attention_bias=True, mlp_bias=True,
                                                  num_attention_heads=4, num_key_value_heads=2))
    tokens_1, logits_1 = serve(str(model_dir), 1)
    tokens_2, logits_2 = serve(str(model_dir), 2)
    assert_no_workers_left()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from tests.test_tensor_parallel import PROMPTS
    for prompt, generated, ours in zip(PROMPTS, tokens_2, logits_2):
        torch.testing.assert_close(ours, reference_logits(hf, prompt, generated).double(), atol=1e-4, rtol=0)
    assert tokens_2 == tokens_1
    for a, b in zip(logits_2, logits_1):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def _last_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32)
    rows: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: rows.append(e.result.logits[0].clone()))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    return rows[0]


def test_old_checkpoint_with_rotary_inv_freq_buffers_loads(tmp_path: Path) -> None:
    """checkpoints converted by older transformers store each layer's RoPE buffer
    `self_attn.rotary_emb.inv_freq`; it is derived from config.json, so it is skipped, not an error."""
    from safetensors.torch import load_file, save_file

    model_dir = write_hf_llama(tmp_path / "old")
    prompt = [5, 9, 17, 3, 44, 101, 7]
    expected = _last_logits(model_dir, prompt)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    head_dim = 64 // 4
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = \
            10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    save_file(tensors, str(path), metadata={"format": "pt"})
    torch.testing.assert_close(_last_logits(model_dir, prompt), expected, atol=0, rtol=0)


# ---- llama: family defaults for keys a config.json leaves out --------------------------------

def _windows(llm: LLM, n: int) -> list[int | None]:
    return [llm.runner.attn_layers[f"model.layers.{i}.self_attn.attn"].sliding_window for i in range(n)]


def test_mistral_without_sliding_window_key_has_transformers_default_window(tmp_path: Path) -> None:
    """a Mistral config.json without `sliding_window` has transformers' default 4096 on
    every layer (MistralConfig's default), not no window."""
    from tests.test_llama_vs_transformers import _family_dir

    def edit(hf: dict) -> None:
        hf.pop("sliding_window", None)
        hf.pop("layer_types", None)

    path = _family_dir(tmp_path / "mistral", "Mistral", dict(sliding_window=8), edit)
    reference = transformers.AutoConfig.from_pretrained(path)
    assert reference.sliding_window == 4096
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    assert _windows(llm, 4) == [reference.sliding_window] * 4


def test_qwen2_without_max_window_layers_uses_the_default_28(tmp_path: Path) -> None:
    """Qwen2 with use_sliding_window but neither layer_types nor max_window_layers:
    transformers' default max_window_layers is 28, so a 4-layer model has no windowed layer.
    Logits against transformers on a prompt (48) longer than the window (8)."""
    from tests.test_llama_vs_transformers import PROMPTS, _family_dir, _logits_match_auto_model

    def edit(hf: dict) -> None:
        del hf["max_window_layers"], hf["layer_types"]

    path = _family_dir(tmp_path / "qwen2", "Qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                         max_window_layers=1), edit)
    reference = transformers.AutoConfig.from_pretrained(path)
    assert reference.layer_types == ["full_attention"] * 4
    llm = _logits_match_auto_model(path, PROMPTS[5])
    assert _windows(llm, 4) == [None] * 4


def test_llama_ignores_use_sliding_window(tmp_path: Path) -> None:
    """Llama has no window whatever its config.json says, `use_sliding_window` (a Qwen2
    key a converted or hand-edited file may carry) included; transformers' Llama ignores it."""
    from tests.test_llama_vs_transformers import PROMPTS, _family_dir, _logits_match_auto_model

    path = _family_dir(tmp_path / "llama", "Llama", {},
                       lambda hf: hf.update(use_sliding_window=True, sliding_window=8, max_window_layers=0))
    llm = _logits_match_auto_model(path, PROMPTS[5])
    assert _windows(llm, 4) == [None] * 4


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


def test_stop_token_ids_stop_the_engine_with_ignore_eos() -> None:
    """The same through the engine: the greedy continuation is cut at the stop token."""
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
    prompt = {"prompt_token_ids": [256, *b"Hello"]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[2]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop"


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
