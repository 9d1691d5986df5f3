"""Getting a model: random-init presets, trained presets shipped with the package, or a local
Hugging Face directory of a Llama-family (Llama, Mistral, Qwen2, Qwen3) or DeepSeek-V2 / V3 model."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedkv.config import CompilationConfig, get_current_engine_config, set_current_engine_config
from pagedkv.distributed import get_tp_size, single_rank
from pagedkv.models.configs import DeepseekV2Config, LlamaConfig, Qwen3Config
from pagedkv.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedkv.models.layers import rope_inv_freq
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.qwen3 import Qwen3ForCausalLM

logger = logging.getLogger("pagedkv")

HFConfig = LlamaConfig | DeepseekV2Config  # Qwen3Config is a LlamaConfig
"""The architecture config of any model pagedkv serves (the fields it reads off `config.json`)."""
CausalLM = LlamaForCausalLM | DeepseekV2ForCausalLM
"""Any model pagedkv serves: forward(input_ids, positions), compute_logits, load_weights."""


class CausalLMClass(Protocol):
    """A model class of MODEL_REGISTRY: built from a config and the prefix its attention layers register under.

    `config` is Any because each class takes only the config class the registry pairs it with
    (LlamaForCausalLM a LlamaConfig, DeepseekV2ForCausalLM a DeepseekV2Config), a pairing by
    architecture name that a type cannot spell; `load_config` builds the config from that same pair.
    """

    def __call__(self, config: Any, prefix: str = "model") -> CausalLM: ...


def _tiny(**extra: Any) -> LlamaConfig:
    """The "tiny" Llama shapes, with `extra` fields on top (a fresh config, so no preset shares a list)."""
    # fmt: off
    return LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       bos_token_id=256, eos_token_id=[257], tie_word_embeddings=True, **extra)
    # fmt: on


def _qwen3(**extra: Any) -> Qwen3Config:
    """What Qwen3-0.6B and Qwen3-8B share (their config.json; eos ids of generation_config.json)."""
    # fmt: off
    return Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, bos_token_id=151643,
                       eos_token_id=[151645, 151643], **extra)
    # fmt: on


# Laid out by hand, one preset per few lines: the formatter's one key per line made the presets look alike.
# fmt: off
PRESETS: dict[str, HFConfig] = {
    # A few hundred thousand parameters: fast on a laptop CPU, big enough to show GQA.
    "tiny": _tiny(),
    # The same, with every other layer looking only at the last 32 tokens: two KV cache groups.
    "tiny-hybrid": _tiny(sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
    # Llama-3-8B's shapes, random weights: for GPU benchmarks.
    "llama3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128009],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # Qwen3-0.6B's and Qwen3-8B's shapes, random weights: for GPU benchmarks.
    # head_dim 128 is not hidden_size / num_attention_heads for the 0.6B (1024 / 16 = 64).
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       tie_word_embeddings=False),
    # Multi-head latent attention and a mixture of experts, as small as "tiny": 3 layers, the
    # first dense, then 4 routed experts (top 2) and 1 shared; the cache holds 32 + 8 values per token.
    "tiny-mla": DeepseekV2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=4096, bos_token_id=256, eos_token_id=[257], tie_word_embeddings=True,
    ),
    # DeepSeek-V2-Lite's shapes (its config.json), random weights: for GPU benchmarks.
    "deepseek-v2-lite": DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        max_position_embeddings=163840, bos_token_id=100000, eos_token_id=[100001],
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
}
# fmt: on

# Presets with trained weights, shipped as package data: name -> Hugging Face checkpoint directory.
TRAINED_PRESETS: dict[str, Path] = {
    # 2.3M parameters trained on Python's reference-manual topics (pydoc_data); byte vocabulary.
    # Made by `python -m pagedkv.models.train_tiny_pydoc`; its training_log.json holds the loss curve.
    "tiny-pydoc": Path(__file__).parent / "data" / "tiny-pydoc",
}

# architecture -> (config class, model class): which model file serves a checkpoint.
MODEL_REGISTRY: dict[str, tuple[type[HFConfig], CausalLMClass]] = {
    "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "MistralForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "Qwen2ForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
    "DeepseekV2ForCausalLM": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "DeepseekV3ForCausalLM": (DeepseekV2Config, DeepseekV3ForCausalLM),
}
# model_type -> architecture, as transformers names them.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED_MODEL_TYPES.values())


def resolve_model(model: str) -> str:
    """`model`, or `./model` where a preset's name is also a local model directory (with a config.json).

    The directory wins, as transformers reads a local path before the Hub: the name means what
    is on disk. A warning (once per name) says so; rename the directory to get the preset.
    """
    if (model in PRESETS or model in TRAINED_PRESETS) and (Path(model) / "config.json").is_file():
        local = os.path.join(os.curdir, model)
        _warn_shadowed_preset(model, local, Path(model).resolve())
        return local
    return model


@functools.cache
def _warn_shadowed_preset(model: str, local: str, resolved: Path) -> None:
    logger.warning(
        "Model %r: reading the local directory %s (%s), not the preset of that name; rename the "
        "directory to use the preset.",
        model,
        local,
        resolved,
    )


def load_config(model: str) -> HFConfig:
    """A random-init preset by name, or the `config.json` of a trained preset or a local directory."""
    if model in PRESETS:
        return PRESETS[model]
    config_file = checkpoint_dir(model) / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"Model {model!r} is neither a preset ({sorted([*PRESETS, *TRAINED_PRESETS])}) nor a directory with a "
            "config.json (a Hugging Face model saved with save_pretrained)."
        )
    hf = _read_json_object(config_file)
    model_type = _model_type(hf, config_file)
    quantization = hf.get("quantization_config")
    if quantization:  # e.g. DeepSeek-V3's own fp8 weights with block scales
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(
            f"{config_file}: quantized checkpoints are not supported (quantization_config, quant_method "
            f"{method!r}); pagedkv loads fp32/fp16/bf16 weights. Save a dequantized copy (e.g. bf16) first."
        )
    config_cls, _ = MODEL_REGISTRY[SUPPORTED_MODEL_TYPES[model_type]]
    try:
        config = config_cls.from_hf_dict(hf, model_type=model_type)
    except (ValueError, TypeError, NotImplementedError) as exc:  # the model file's checks know no path
        raise type(exc)(f"{config_file}: {str(exc).removeprefix('config.json: ')}") from exc
    try:  # the frequencies of a tiny head: a scaling without a key it needs fails here, not in the model build
        rope_inv_freq(8, config.rope_theta, config.rope_scaling)
    except KeyError as exc:
        raise ValueError(
            f"{config_file}: RoPE scaling {config.rope_scaling} has no {exc}, which its type needs "
            "(transformers refuses it too)."
        ) from None
    except NotImplementedError as exc:
        raise NotImplementedError(f"{config_file}: {exc}") from None
    _eos_ids(hf.get("eos_token_id"), config_file, config.vocab_size)
    _token_id("bos_token_id", hf.get("bos_token_id"), config_file, config.vocab_size)
    _token_id("pad_token_id", hf.get("pad_token_id"), config_file, None)
    return config


def checkpoint_dir(model: str) -> Path:
    """The directory holding `model`'s checkpoint: a trained preset's package data, else `model` itself."""
    return TRAINED_PRESETS.get(model, Path(model))


def _read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, or a ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}.") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object ({{...}}), not a {type(data).__name__}.")
    return data


def _model_type(hf: dict[str, Any], config_file: Path) -> str:
    """The family of a `config.json`: its `model_type`, else read off `architectures`, else "llama".

    Either field naming anything but a supported model is rejected, as is a file
    whose two fields disagree; a hand-written config with neither field is read as Llama.
    """
    model_type, archs = hf.get("model_type"), hf.get("architectures")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not supported; supported model types: "
            f"{list(SUPPORTED_MODEL_TYPES)}."
        )
    if archs is None:
        return model_type or "llama"
    if not isinstance(archs, list) or not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{config_file}: architectures {archs!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)} "
            "(a list whose first entry is one of them)."
        )
    arch_type = next(t for t, a in SUPPORTED_MODEL_TYPES.items() if a == archs[0])
    if model_type is not None and model_type != arch_type:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} contradicts architectures {archs!r} "
            f"({archs[0]} is model_type {arch_type!r}); fix one of them."
        )
    return arch_type


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint, in transformers' order of preference.

    `model.safetensors` (one file), else the shards that `model.safetensors.index.json` lists,
    else shards `model-*-of-*.safetensors` without their index. Other safetensors files in the
    directory (Mistral's `consolidated.safetensors`, `model.fp16.safetensors`, an older save) are
    not read: loaded too, they would overwrite the weights with others.
    """
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file).")
        for tensor, name in weight_map.items():
            # Lexical, not resolved: a Hugging Face cache snapshot's files are links into ../../blobs.
            if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(
                    f"{index}: weight_map[{tensor!r}] = {name!r} is not a file name inside {model_dir} (shards "
                    "are named relative to the model directory, such as 'model-00001-of-00002.safetensors')."
                )
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that are not in {model_dir}: {missing}.")
        return files
    files = sorted(model_dir.glob("model-*-of-*.safetensors"))
    if not files:
        others = sorted(f.name for f in model_dir.glob("*.safetensors"))
        raise ValueError(
            f"No model.safetensors, model.safetensors.index.json or model-*-of-*.safetensors shards in {model_dir}"
            + (f"; {others} are not in the Hugging Face layout" if others else "")
            + ". Save the model with transformers' save_pretrained."
        )
    return files


def checkpoint_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every safetensors file, on `device`; a file that cannot be read, or a
    tensor that is not floating point (int64 or bool weights are no model's), names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for file in files:
        try:
            tensors = load_file(file, device=str(device))
        except SafetensorError as exc:  # a truncated or corrupt file
            raise ValueError(f"{file} is not a readable safetensors file ({exc}); download or save it again.") from exc
        for name, tensor in tensors.items():
            if not tensor.is_floating_point():
                raise ValueError(
                    f"{file}: tensor {name!r} is {tensor.dtype}; weights must be floating point (float32, float16, "
                    "bfloat16), as save_pretrained writes them."
                )
            yield name, tensor


def generation_eos_token_ids(model: str, vocab_size: int) -> list[int]:
    """The `eos_token_id` of a model directory's `generation_config.json`; [] without the file or
    the key, and for random-init presets."""
    gen = checkpoint_dir(model) / "generation_config.json"
    if model in PRESETS or not gen.is_file():
        return []
    return _eos_ids(_read_json_object(gen).get("eos_token_id"), gen, vocab_size)


def _eos_ids(eos: object, file: Path, vocab_size: int) -> list[int]:
    """An `eos_token_id` entry (None, an id or a list of ids) as a list; ids are ints in [0, vocab_size)."""
    entries: list[object] = [] if eos is None else eos if isinstance(eos, list) else [eos]
    ids = [t for t in entries if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size]
    if len(ids) != len(entries):
        raise ValueError(
            f"{file}: eos_token_id {eos!r} must be a token id or a list of them, ints in [0, {vocab_size}) "
            "(the model's vocab_size)."
        )
    return ids


def _token_id(name: str, value: object, file: Path, vocab_size: int | None) -> None:
    """A `bos_token_id` / `pad_token_id` entry: null or an int, in [0, vocab_size) unless that is None
    (old Llama configs say pad_token_id -1). Checked here because transformers' tokenizer reads
    config.json too, and its failure named the tokenizer instead of this file."""
    if value is None:
        return
    if type(value) is not int or (vocab_size is not None and not 0 <= value < vocab_size):
        where = "an int" if vocab_size is None else f"an int in [0, {vocab_size})"
        raise ValueError(f"{file}: {name} {value!r} must be a token id ({where}) or null.")


# Presets drawn on the CPU with weights scaled so that attention decides the output.
ATTENTION_DRIVEN_PRESETS = ("tiny", "tiny-hybrid", "tiny-mla")


def init_preset_weights(net: CausalLM, model: str, seed: int) -> None:
    """Seeded random weights for a preset; RMSNorm weights keep their 1s.

    N(0, 0.02) everywhere (Hugging Face's Llama init) leaves a tiny model nearly blind to its
    context: the residual stream is almost only the current token's embedding, and with tied
    embeddings greedy decoding repeats the last prompt token whatever attention computes, so
    a broken attention backend would still produce the right tokens. The tiny presets are
    scaled instead so that attention decides the next token:

    - q, k, v, o (every projection of MLA's too): std 2 / sqrt(fan_in). Scores q.k / sqrt(head_dim)
      spread over several units, so each head attends to a few context positions, and what it
      reads (v, o) outweighs the current token's embedding in the residual stream.
    - MLP, experts and the MoE router: std 1 / sqrt(fan_in).
    - Embeddings (tied with lm_head): std 0.5, so logits spread by about sqrt(hidden) * 0.5 and
      greedy choices are rarely near a tie.

    Replacing attention by zeros, or never writing the KV cache, then changes the greedy
    continuation of every prompt of the engine tests (tests/attention/test_broken_backends.py checks it).
    The tiny presets are drawn on the CPU, so every device gets the same weights; the others
    (benchmark shapes, billions of weights) are drawn on their device with N(0, 0.02).
    """
    if model not in ATTENTION_DRIVEN_PRESETS:
        generator = torch.Generator(device=net.lm_head.weight.device).manual_seed(seed)
        for name, param in net.named_parameters():
            if "norm" not in name:
                param.data.normal_(0.0, 0.02, generator=generator)
        return
    generator = torch.Generator().manual_seed(seed)
    for name, param in net.named_parameters():  # the tied lm_head is the embedding: listed once
        if "norm" in name:
            continue
        if "embed_tokens" in name:
            std = 0.5
        else:  # Linear weights are [out, in]
            std = (2.0 if ".self_attn." in name else 1.0) / param.shape[-1] ** 0.5
        param.data.copy_(torch.empty(param.shape).normal_(0.0, std, generator=generator))


def weight_bytes(config: HFConfig) -> tuple[int, int]:
    """(bytes, parameters) of what `load_model` builds before casting to the engine's dtype: this
    rank's parameters and buffers, counted on the meta device (nothing allocated). The layers
    register in a scratch registry, so that the real build can take their names."""
    _, model_cls = MODEL_REGISTRY[config.architecture]
    scratch = dataclasses.replace(get_current_engine_config(), compilation_config=CompilationConfig())
    with set_current_engine_config(scratch), torch.device("meta"):
        net = model_cls(config)
    tensors = itertools.chain(net.parameters(), net.buffers())
    return sum(t.numel() * t.element_size() for t in tensors), sum(p.numel() for p in net.parameters())


def load_model(
    model: str, config: HFConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, prefix: str = "model"
) -> CausalLM:
    """Build the model on `device` and fill it: checkpoint tensors, or seeded random weights. Its
    attention layers register as `{prefix}.layers.{i}...` (a draft model beside the target: "draft.model").

    Then each module with a `process_weights_after_loading` gets to prepare its weights for
    serving (MLA's attention layer splits kv_b_proj into W_UK and W_UV), as in vLLM.
    """
    _, model_cls = MODEL_REGISTRY[config.architecture]
    with torch.device(device):
        net = model_cls(config, prefix)
    if model in ATTENTION_DRIVEN_PRESETS and get_tp_size() > 1:
        # Draw the whole model as one rank would, then keep this rank's shard: tensor-parallel
        # ranks serve exactly the weights of the single-rank engine.
        with single_rank():
            whole = model_cls(config, prefix)
        # MLA models never get here: DeepseekV2Config.supports_tensor_parallel is False.
        assert isinstance(whole, LlamaForCausalLM), f"{type(whole).__name__} cannot be split over ranks"
        init_preset_weights(whole, model, seed)
        net.load_weights(whole.hf_state_dict().items())
    elif model in PRESETS:  # the big benchmark presets: each rank draws its own shard
        init_preset_weights(net, model, seed)
    else:
        net.load_weights(checkpoint_tensors(checkpoint_files(checkpoint_dir(model)), device))
    keep = {name: p.detach().float() for name, p in net.named_parameters() if name.endswith(net.keep_in_float32)}
    net = net.to(dtype=dtype).eval()
    for name, param in net.named_parameters():
        if name in keep:
            param.data = keep[name]
    for module in net.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
    return net
