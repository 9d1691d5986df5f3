"""Loading a model directory (which files, which config), the backend registry, the byte
tokenizer, and what importing pagedkv does to the process environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import (
    get_attn_backend,
    load_backend,
    register_backend,
    unregister_backend,
)
from pagedkv.models.loader import load_config
from pagedkv.models.tokenizer import ByteTokenizer
from tests.conftest import edit_config_json, write_hf_llama

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 9, 17, 3, 44, 101, 7, 12, 60]


def _last_logits(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') logits of PROMPT's last token, from the same directory."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    captured: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: captured.append(e.result.logits[0].clone()))
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return captured[0], ref(torch.tensor([PROMPT])).logits[0, -1]


# ---- which safetensors files are read -------------------------------------------------------


@pytest.mark.parametrize("layout", ["single-file", "sharded-with-index", "single-file-beside-stale-shards"])
def test_only_the_hf_checkpoint_files_are_read(tmp_path: Path, layout: str) -> None:
    """The files transformers reads, and no others: Mistral repositories also ship
    `consolidated.safetensors` (other tensor names); a directory may hold other saves of the same
    tensors with other values (`model.fp16.safetensors`, an older sharded save). Read too, those
    would overwrite the weights."""
    src = write_hf_llama(tmp_path / "src")
    model_dir = tmp_path / "model"
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(model_dir, max_shard_size="40KB" if layout == "sharded-with-index" else "1GB")
    assert (model_dir / "model.safetensors.index.json").is_file() == (layout == "sharded-with-index")
    safetensors_torch.save_file(
        {"tok_embeddings.weight": torch.randn(3, 4), "layers.0.attention.wq.weight": torch.randn(4, 4)},
        str(model_dir / "consolidated.safetensors"),
    )
    other = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    safetensors_torch.save_file(other, str(model_dir / "model.fp16.safetensors"))
    if layout == "single-file-beside-stale-shards":
        safetensors_torch.save_file(other, str(model_dir / "model-00001-of-00001.safetensors"))
        (model_dir / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {name: "model-00001-of-00001.safetensors" for name in other}})
        )
    ours, expected = _last_logits(model_dir)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_no_hf_checkpoint_file_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    (model_dir / "model.safetensors").rename(model_dir / "consolidated.safetensors")
    with pytest.raises(ValueError, match=r"No model\.safetensors, .*'consolidated\.safetensors'"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


def test_shards_without_their_index_are_read(tmp_path: Path) -> None:
    """Shards named as save_pretrained names them, but no index.json: read all of them."""
    src = write_hf_llama(tmp_path / "src")
    model_dir = tmp_path / "model"
    transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(
        model_dir, max_shard_size="40KB"
    )
    (model_dir / "model.safetensors.index.json").unlink()
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    reference = LLM(str(src), device="cpu", dtype="float32", num_kv_blocks=16)
    for ours, theirs in zip(llm.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(ours, theirs)


def test_index_naming_a_missing_shard_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json names shard files .*'model-00002-of-00002\.safetensors'"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("stored", ["embedding-only", "lm_head-only", "both-equal", "both-different"])
def test_tied_embeddings_read_as_transformers_reads_them(
    tmp_path: Path, stored: str, caplog: pytest.LogCaptureFixture
) -> None:
    """tie_word_embeddings with the embedding, the lm_head or both in the file. transformers ties
    the one table it finds to both uses, and unties a pair that differs (a file that is not a
    tied model, whatever its config says): so must the engine, saying so. Before, the engine
    always took the embedding (logits off when they differ) and refused a file with only lm_head."""
    model_dir = write_hf_llama(tmp_path / "model", tie_word_embeddings=True)
    path = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    embedding = tensors.pop("model.embed_tokens.weight")
    assert "lm_head.weight" not in tensors  # save_pretrained writes a tied table once
    if stored != "lm_head-only":
        tensors["model.embed_tokens.weight"] = embedding
    if stored != "embedding-only":
        tensors["lm_head.weight"] = torch.randn_like(embedding) if stored == "both-different" else embedding.clone()
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="pagedkv"):
        ours, expected = _last_logits(model_dir)
    assert (ours - expected).abs().max().item() <= 1e-4
    untied = stored == "both-different"
    assert ("loading them untied, as transformers does" in caplog.text) == untied
    model = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16).model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (not untied)
    assert model.config.tie_word_embeddings == (not untied)


@pytest.mark.parametrize(
    ("changes", "tensor", "shapes"),
    [
        (dict(intermediate_size=48), "mlp.down_proj.weight", r"checkpoint \(64, 96\), expected \(64, 48\)"),
        (dict(num_key_value_heads=1), "self_attn.k_proj.weight", r"checkpoint \(32, 64\), expected \(16, 64\)"),
        (dict(head_dim=32), "self_attn.k_proj.weight", r"checkpoint \(32, 64\), expected \(64, 64\)"),
    ],
)
def test_weights_of_other_sizes_than_config_json_are_refused(
    tmp_path: Path, changes: dict, tensor: str, shapes: str
) -> None:
    """A config.json that does not belong to its weights. Smaller sizes than the checkpoint's were
    loaded without a word (each layer cut its slice out of the larger tensor, as a tensor-parallel
    rank does): wrong weights, wrong tokens. The whole tensor is checked first now."""
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, **changes)
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.{tensor}': Shape mismatch .*: {shapes} from config"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


# ---- config.json ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["{'model_type': 'llama'}", '{"hidden_size": 64,}', "", "\xff\xfe junk"])
def test_config_json_that_is_not_json(tmp_path: Path, text: str) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    (model_dir / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON: ") as err:
        load_config(str(model_dir))
    assert str(model_dir) in str(err.value)


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object .*not a list"):
        load_config(str(model_dir))


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(model_type="gpt2", architectures=None),
            r"model_type 'gpt2' is not supported; supported model types: "
            r"\['llama', 'mistral', 'qwen2', 'qwen3', 'deepseek_v2', "
            r"'deepseek_v3'\]",
        ),
        (dict(model_type="gpt2"), r"model_type 'gpt2' is not supported"),
        (
            dict(model_type=None, architectures=["GPT2LMHeadModel"]),
            r"architectures \['GPT2LMHeadModel'\] is not "
            r"supported; supported: \['LlamaForCausalLM'",
        ),
        (dict(architectures=[]), r"architectures \[\] is not supported"),
        (dict(model_type="qwen2"), r"model_type 'qwen2' contradicts architectures \['LlamaForCausalLM'\]"),
    ],
    ids=["gpt2-no-architectures", "gpt2", "gpt2-architectures-only", "empty-architectures", "contradiction"],
)
def test_unsupported_or_contradictory_model_is_rejected(tmp_path: Path, changes: dict, message: str) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_attention_heads=0), r"num_attention_heads must be an int >= 1, got 0"),  # was a ZeroDivisionError
        (dict(max_position_embeddings="1024"), r"max_position_embeddings must be an int >= 1, got '1024'"),
        (dict(hidden_size=-64), r"hidden_size must be an int >= 1, got -64"),  # was torch's "Dimension size"
        (dict(rms_norm_eps="x"), r"rms_norm_eps must be a number > 0, got 'x'"),  # was accepted
        # Was the attention layer's message without the file (a Qwen3 config without num_key_value_heads has 32).
        (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        (dict(attention_bias="yes"), r"attention_bias must be true or false, got 'yes'"),  # was "missing 8 tensors"
    ],
)
def test_config_json_numbers_are_checked_by_name(tmp_path: Path, changes: dict, message: str) -> None:
    """Named with the file's path (the model file's own checks say only "config.json")."""
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, **changes)
    with pytest.raises(ValueError, match="^" + re.escape(f"{model_dir / 'config.json'}: ") + message):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


def test_deepseek_config_json_numbers_are_checked_by_name() -> None:
    from pagedkv.models.configs import DeepseekV2Config

    with pytest.raises(ValueError, match=r"config\.json: kv_lora_rank must be an int >= 1, got 0"):
        DeepseekV2Config.from_hf_dict(dict(kv_lora_rank=0), "deepseek_v2")
    with pytest.raises(ValueError, match=r"config\.json: n_shared_experts must be an int >= 0, got -1"):
        DeepseekV2Config.from_hf_dict(dict(n_shared_experts=-1), "deepseek_v2")
    assert DeepseekV2Config.from_hf_dict(dict(q_lora_rank=None, n_shared_experts=0), "deepseek_v2").q_lora_rank is None


def test_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    """DeepSeek-V3's released weights are fp8 with per-block scales; read as plain weights they
    would load as garbage (or fail on the scale tensors), so the config is refused by name."""
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"quantized checkpoints are not supported .*quant_method 'fp8'"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


def test_family_from_either_field_or_llama_without_both(tmp_path: Path) -> None:
    """model_type alone, architectures alone, or (a hand-written Llama config) neither."""
    write_hf_llama(tmp_path / "qwen2", family="Qwen2")
    edit_config_json(tmp_path / "qwen2", model_type=None)
    assert load_config(str(tmp_path / "qwen2")).qkv_bias  # Qwen2's q/k/v biases, from architectures alone
    edit_config_json(tmp_path / "qwen2", model_type="qwen2", architectures=None)
    assert load_config(str(tmp_path / "qwen2")).qkv_bias

    llama = write_hf_llama(tmp_path / "llama")
    expected = load_config(str(llama))
    edit_config_json(llama, model_type=None, architectures=None)
    assert load_config(str(llama)) == expected


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(layer_types=["sliding_attention"]), r"layer_types must be a list with one entry per layer \(2\)"),
        (
            dict(layer_types=["full_attention", "linear_attention"]),
            r"layer_types has unsupported entries "
            r"\['linear_attention'\]",
        ),
        (dict(sliding_window=0), r"sliding_window must be a positive int or None, got 0"),
    ],
    ids=["layer_types-length", "layer_types-entry", "sliding_window"],
)
def test_bad_window_fields_are_rejected(tmp_path: Path, changes: dict, message: str) -> None:
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, model_type="mistral", architectures=["MistralForCausalLM"], **changes)
    with pytest.raises(ValueError, match=message):
        load_config(str(model_dir))


# ---- the backend registry -------------------------------------------------------------------


class _Mine(TorchRefBackend):
    """A user backend registered under a built-in's name."""

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF"


LAYER = dict(head_size=16, dtype=torch.float32, kv_cache_dtype=torch.float32, block_size=16, device="cpu")


@pytest.mark.parametrize("prefer", [False, True])
def test_unregistering_a_builtin_name_restores_the_builtin(prefer: bool) -> None:
    try:
        register_backend(_Mine, prefer=prefer)
        assert load_backend("TORCH_REF") is _Mine
        assert get_attn_backend(**LAYER) is _Mine
        unregister_backend("TORCH_REF")
        assert load_backend("TORCH_REF") is TorchRefBackend
        assert get_attn_backend(**LAYER) is TorchRefBackend
        llm = LLM("tiny", device="cpu", num_kv_blocks=16)
        assert {layer.attn_backend for layer in llm.runner.attn_layers.values()} == {TorchRefBackend}
    finally:
        register_backend(TorchRefBackend)  # whatever happened above, leave the built-in for other tests


def test_unregistering_a_user_name_removes_it() -> None:
    class _Other(TorchRefBackend):
        @staticmethod
        def get_name() -> str:
            return "OTHER"

    register_backend(_Other)
    assert load_backend("OTHER") is _Other
    unregister_backend("OTHER")
    with pytest.raises(ValueError, match="Unknown attention backend 'OTHER'"):
        load_backend("OTHER")


# ---- the byte tokenizer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids,text",
    [
        ([72, 300, 105], "H\ufffdi"),  # an id past the bytes: one U+FFFD where it stands
        ([300, 72, 319, 319, 105, 258], "\ufffdH\ufffd\ufffdi\ufffd"),
        ([256, 72, 105, 257], "Hi"),  # BOS and EOS are special tokens: skipped
        ([0xC3, 0xA9], "\u00e9"),  # two bytes, one character
        ([0xC3, 257, 0xA9], "\u00e9"),  # a skipped special token does not split a character
        ([0xC3, 300, 0xA9], "\ufffd\ufffd\ufffd"),  # half a character, a stray id, the other half
        ([0xFF, 72], "\ufffdH"),  # not UTF-8
        ([0xE2, 0x82, 300, 0xAC], "\ufffd\ufffd\ufffd"),  # 2 of 3 bytes of a character, a stray id, the last byte
        ([0xE2, 0x82, 0xAC, 300], "\u20ac\ufffd"),
    ],
)
def test_byte_tokenizer_decode(ids: list[int], text: str) -> None:
    assert ByteTokenizer().decode(ids) == text


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "paged \u00e9t\u00e9 \u2014 \U0001f600"
    assert tok.encode(text)[0] == tok.bos_token_id
    assert tok.decode(tok.encode(text) + [tok.eos_token_id]) == text


# ---- importing pagedkv and the Triton interpreter -------------------------------------------


def _python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter without TRITON_INTERPRET (plus `env`); what it sets in `out`."""
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    code = "import contextlib, io, json, os\nout = {}\n" + code + "print(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=child_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


IMPORTS = (
    "before = dict(os.environ)\n"
    "import pagedkv, pagedkv.kernels, pagedkv.attention.backends.triton_attn\n"
    "from pagedkv import LLM\n"
    "LLM('tiny', device='cpu', num_kv_blocks=8)\n"
    "out['changed'] = sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k))\n"
)
REASONS = (
    "import torch\n"
    "from pagedkv.attention.selector import backend_reasons\n"
    "out['reasons'] = backend_reasons('TRITON_ATTN', head_size=16, dtype=torch.float32, "
    "kv_cache_dtype=torch.float32, block_size=16, device_type='cpu')\n"
)
ENGINE_ERROR = (
    "try:\n"
    "    LLM('tiny', device='cpu', attention_backend='TRITON_ATTN', num_kv_blocks=8)\n"
    "except ValueError as exc:\n"
    "    out['engine_error'] = str(exc)\n"
)
BACKENDS_COMMAND = (
    "from pagedkv.__main__ import main\n"
    "with contextlib.redirect_stdout(io.StringIO()) as printed:\n"
    "    main(['backends', '--device', 'cpu'])\n"
    "out['backends_line'] = [line for line in printed.getvalue().splitlines() if 'TRITON_ATTN' in line]\n"
)
HINT = "set TRITON_INTERPRET=1 in the environment before Python starts"


def test_importing_pagedkv_leaves_the_environment_alone() -> None:
    assert _python(IMPORTS)["changed"] == []


triton_only = pytest.mark.skipif(not __import__("pagedkv.kernels").kernels.HAS_TRITON, reason="triton is not installed")


@triton_only
def test_triton_on_cpu_without_the_interpreter_says_what_to_do() -> None:
    """TRITON_ATTN's reason, the engine's error and `python -m pagedkv backends` say what to set."""
    out = _python(IMPORTS + REASONS + ENGINE_ERROR + BACKENDS_COMMAND)
    [reason] = out["reasons"]
    assert reason.startswith("on the CPU, Triton runs only in its interpreter: ") and HINT in reason
    assert "'TRITON_ATTN' cannot serve layer" in out["engine_error"] and HINT in out["engine_error"]
    [line] = out["backends_line"]
    assert HINT in line


@triton_only
def test_triton_interpreter_set_after_triton_was_imported() -> None:
    [reason] = _python("import triton\nos.environ['TRITON_INTERPRET'] = '1'\n" + REASONS)["reasons"]
    assert reason.startswith("TRITON_INTERPRET=1 was set after triton had been imported") and HINT in reason


@triton_only
def test_triton_interpreter_set_before_python_starts() -> None:
    """Then import order does not matter (transformers, which may import triton, first here)."""
    out = _python("import transformers\n" + REASONS + BACKENDS_COMMAND, TRITON_INTERPRET="1")
    if out["reasons"] and "interpreter cannot run a loop" in out["reasons"][0]:  # kernels.common's probe
        pytest.skip(out["reasons"][0])  # these triton / numpy versions: no interpreter to order imports for
    assert out["reasons"] == []
    [line] = out["backends_line"]
    assert "TRITON_INTERPRET" not in line


def test_tiny_preset_logits_spread_as_documented() -> None:
    """`init_preset_weights` draws the tied embedding with std 0.5 so that logits spread
    by about sqrt(hidden) * 0.5 = 4 and greedy choices are rarely near a tie. With HF's 0.02 the
    spread is ~0.16 and the cross-backend greedy comparisons sit on near-ties."""
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
    rows: list[torch.Tensor] = []
    llm.add_step_listener(lambda e: rows.extend(e.result.logits.clone()))
    llm.generate(
        [{"prompt_token_ids": [256, *b"Hello world"]}, {"prompt_token_ids": [256, *b"paged"]}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    spread = torch.stack(rows).std(dim=-1)
    assert spread.min().item() > 1.5 and spread.max().item() < 12, spread
    embedding = llm.model.model.embed_tokens.weight
    assert abs(embedding.std().item() - 0.5) < 0.05
