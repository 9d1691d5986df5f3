"""`EngineArgs`: every argument of `LLM` in one place, checked, then turned into an `EngineConfig`.

    LLM("tiny", max_num_seqs=8)   ->   EngineArgs("tiny", max_num_seqs=8).create_engine_config()

As in vLLM, the front end takes plain values (strings, ints, None for "pick for me") and this
module owns what they mean: the defaults, the checks, and the resolution of the "None" values
that depend on the model (max_model_len) or the machine (device, dtype). Everything is checked
before anything is built: a wrong type is a `TypeError`, a value out of range a `ValueError`,
each naming the argument and saying what would work.
"""

from __future__ import annotations

import argparse
import ast
import enum
import inspect
import itertools
import json
import math
import os
import textwrap
import typing
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch

from pagedkv.attention.selector import ENV_VAR as ATTENTION_BACKEND_ENV
from pagedkv.checks import check_bool, check_float, check_int, check_optional_bool, check_optional_int
from pagedkv.config import (
    SPECULATIVE_METHODS,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_kv_cache_dtype,
)
from pagedkv.engine.checks import check_compilation, check_device, check_dtype, check_model, check_tensor_parallel
from pagedkv.engine.request import SEED_RANGE
from pagedkv.kv_cache.fp8 import is_fp8
from pagedkv.models.loader import PRESETS, TRAINED_PRESETS, HFConfig, load_config

ASYNC_SCHEDULING_ENV = "PAGEDKV_ASYNC_SCHEDULING"
"""Overrides the device default of `async_scheduling` (the CPU test suite runs once with it on)."""
BATCH_INVARIANT_ENV = "PAGEDKV_BATCH_INVARIANT"
"""Turns `batch_invariant` on ("1") where the argument is None (vLLM's VLLM_BATCH_INVARIANT)."""


@dataclass
class EngineArgs:
    """The arguments of `LLM`, as the user gives them (see `create_engine_config` for the checks).

    An argument a config also has takes that config's default (pagedkv/config.py writes each default
    once), except those in `RESOLVED_AT_START_UP`, whose None means "pick for this model / machine".
    """

    model: str = "tiny"
    """A preset name (`pagedkv.models.loader.PRESETS`, `TRAINED_PRESETS`) or a local Hugging Face directory;
    a directory named like a preset (with a config.json) wins over it, as transformers reads a local path first."""
    device: str | torch.device | None = None
    """Where the model runs; None: the GPU if there is one, else the CPU."""
    dtype: str | torch.dtype | None = None
    """Weights and activations ("float32", "bfloat16", ...); None: bf16 on a GPU, fp32 on the CPU."""
    block_size: int = CacheConfig.block_size
    """Tokens per KV cache block (page)."""
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    """Blocks in the KV cache (block 0 is the reserved null block); None: sized from memory."""
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    """Most requests in one step."""
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    """The token budget of one step (prompt chunks + one token per decode)."""
    max_model_len: int | None = None
    """Longest request (prompt + output); None: the model's max_position_embeddings."""
    attention_backend: str | None = EngineConfig.attention_backend
    """Backend of every attention layer ("TRITON_ATTN", "TORCH_REF", ...); None: $PAGEDKV_ATTENTION_BACKEND,
    else the selector's choice per layer."""
    layer_attention_backends: dict[str, str] | None = None
    """Per-layer overrides, layer name -> backend name (e.g. {"model.layers.3.self_attn.attn": "TORCH_REF"})."""
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    """Split long prompts over several steps; off, a whole prompt must fit one step's budget."""
    kv_cache_dtype: str = CacheConfig.cache_dtype
    """What the KV cache stores: "auto" (the model dtype), or "fp8" / "fp8_e4m3" (float8_e4m3fn: half the bytes
    of bf16, so twice the blocks, with a per-layer K and V scale, 1.0 unless kv_cache_scales gives it or
    calculate_kv_scales computes it; pagedkv/kv_cache/fp8.py)."""
    kv_cache_scales: dict[str, tuple[float, float]] | None = None
    """With an fp8 KV cache: attention layer name -> (k_scale, v_scale) (the cache stores K / k_scale,
    V / v_scale), e.g. {"model.layers.0.self_attn.attn": (0.02, 0.01)}; the layers not named keep 1.0, or
    with calculate_kv_scales get theirs from the profile run. None: no layer named."""
    calculate_kv_scales: bool = CacheConfig.calculate_kv_scales
    """With an fp8 KV cache: set each layer's scales from the profile run's K and V (amax / 200 and amax / 100)
    instead of 1.0, except where kv_cache_scales gives them (vLLM's calculate_kv_scales). That run is
    max_num_batched_tokens synthetic tokens, so the scales, and the outputs, change with that budget."""
    kv_cache_memory: int | None = CacheConfig.kv_cache_memory
    """Bytes for the KV cache; None: on a GPU what `gpu_memory_utilization` leaves after the weights and
    a profile run, on the CPU a fixed default (either way no more than max_num_seqs requests of
    max_model_len tokens can use)."""
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    """Share in (0, 1] of the GPU's memory the engine may use in all (the name and meaning as in vLLM)."""
    seed: int = ModelConfig.seed
    """Seed of a preset's random weights, and of unseeded requests' sampling (each such request draws from
    a seed hashed from this one and its arrival number; a seeded request from SamplingParams.seed)."""
    cudagraph_mode: CUDAGraphMode | str | None = None
    """CUDA graph mode (pagedkv.worker.cudagraph), lowered at start-up to what the attention backends
    allow; None: FULL_AND_PIECEWISE on CUDA (FULL_DECODE_ONLY where compile is off, e.g. with
    tensor_parallel_size > 1), NONE on the CPU or with enforce_eager. A replayed graph runs none
    of the model's Python (hooks, the forward context): pass enforce_eager=True to inspect it."""
    enforce_eager: bool = CompilationConfig.enforce_eager
    """Run every step eagerly, whatever cudagraph_mode says (no graph is captured); with
    compile=None it also leaves the model uncompiled."""
    compile: bool | None = None
    """Trace the forward with torch.compile, split at the attention ops (piecewise graphs need it);
    None: on with CUDA (unless enforce_eager, or tensor_parallel_size > 1, which refuses it), off
    on the CPU. Compiled pieces are cached in $PAGEDKV_CACHE_DIR (pagedkv.compilation.cache)."""
    max_cudagraph_capture_size: int | None = CompilationConfig.max_cudagraph_capture_size
    """Largest batch (tokens) that gets a graph; None: min(2 x max_num_seqs x (1 + speculative tokens), 512),
    never more than max_num_batched_tokens."""
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    """Processes, each holding a shard of the model (tensor parallelism)."""
    enable_prefix_caching: bool | None = None
    """Share the KV cache blocks of equal prompt prefixes; None: on where the model allows it."""
    async_scheduling: bool | None = None
    """Plan and launch step N+1 while the GPU runs step N (vLLM's async_scheduling); None: on with
    CUDA, off on the CPU (where the model runs on the host thread, so nothing could overlap), unless
    $PAGEDKV_ASYNC_SCHEDULING is "1" or "0". Always off with speculative decoding (the next step's
    drafts need this step's accepted tokens)."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding (pagedkv.config.SpeculativeConfig, vLLM's keys), e.g. {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method":
    "draft_model", "model": "tiny-pydoc", "num_speculative_tokens": 2}; on the command line as JSON.
    None: one new token per decoding request and step."""
    batch_invariant: bool | None = None
    """Bitwise-identical logits for a request whatever else is in its batch and however its prompt was
    chunked or cached (pagedkv/batch_invariant.py): fixed-tile matmuls, per-row norms and
    softmax, attention without split-KV. Costs speed; leaves compile off unless compile=True is given
    and picks TRITON_ATTN on CUDA unless a backend is given. None: $PAGEDKV_BATCH_INVARIANT ("1"), else off."""

    def create_engine_config(self) -> tuple[EngineConfig, HFConfig]:
        """Check every argument and resolve the defaults; returns the engine config and the model's config."""
        model = check_model(self.model, sorted([*PRESETS, *TRAINED_PRESETS]))
        device = check_device(self.device)
        dtype = check_dtype(self.dtype, device)
        block_size = check_int("block_size", self.block_size, 1, hint=" (tokens per KV cache block)")
        num_kv_blocks = check_optional_int(
            "num_kv_blocks",
            self.num_kv_blocks,
            2,
            hint=" or None: at least 2 are needed (block 0 is the reserved null block); None sizes the cache "
            "from memory",
        )
        max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1, hint=" (most requests in one step)")
        max_num_batched_tokens = check_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, 1, hint=" (the token budget of one step)"
        )
        max_model_len = check_optional_int(
            "max_model_len",
            self.max_model_len,
            2,
            hint=" or None for the model's limit (room for a 1-token prompt and one new token)",
        )
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise TypeError(f"attention_backend must be a backend name (str) or None, got {self.attention_backend!r}.")
        layers = self.layer_attention_backends
        if layers is not None and not (
            isinstance(layers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in layers.items())
        ):
            raise TypeError(
                "layer_attention_backends must map layer names (str) to backend names (str), e.g. "
                f"{{'model.layers.3.self_attn.attn': 'TORCH_REF'}}, or None; got {layers!r}."
            )
        enable_chunked_prefill = check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if not isinstance(self.kv_cache_dtype, str):
            raise TypeError(f"kv_cache_dtype must be a name such as 'auto' or 'fp8', got {self.kv_cache_dtype!r}.")
        kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype, dtype)  # an unknown name is refused here
        kv_cache_scales = check_kv_cache_scales(self.kv_cache_scales, kv_cache_dtype)
        calculate_kv_scales = check_bool("calculate_kv_scales", self.calculate_kv_scales)
        if calculate_kv_scales:
            check_fp8_cache("calculate_kv_scales=True", kv_cache_dtype)
        kv_cache_memory = check_optional_int("kv_cache_memory", self.kv_cache_memory, 1, hint=" (bytes) or None")
        gpu_memory_utilization = check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        seed = check_int("seed", self.seed, *SEED_RANGE)
        tensor_parallel_size = check_int(
            "tensor_parallel_size", self.tensor_parallel_size, 1, hint=" (processes, each holding a shard of the model)"
        )
        batch_invariant = resolve_batch_invariant(self.batch_invariant)
        compilation = check_compilation(
            self.cudagraph_mode,
            self.enforce_eager,
            self.compile,
            self.max_cudagraph_capture_size,
            device,
            tensor_parallel_size,
            batch_invariant,
        )
        check_optional_bool(
            "enable_prefix_caching", self.enable_prefix_caching, hint=" (None: on where the model allows it)"
        )
        model_cfg = load_config(model)
        check_tensor_parallel(tensor_parallel_size, model_cfg, device, compilation)
        speculative = check_speculative_config(self.speculative_config, model_cfg)
        draft_model = None if speculative is None else speculative.model
        draft_cfg = None if draft_model is None else load_config(draft_model)
        if draft_cfg is not None:
            try:
                check_tensor_parallel(tensor_parallel_size, draft_cfg, device, compilation)
            except (ValueError, NotImplementedError) as error:  # its message speaks of "the model": say which
                raise type(error)(f"The draft model {draft_model!r} (speculative_config['model']): {error}") from None
        if speculative is not None and self.async_scheduling:
            raise ValueError(
                "async_scheduling=True cannot run with speculative_config: a step's drafts are proposed from the "
                "tokens the step before accepted, so the host must read them first. Pass async_scheduling=None or False."
            )
        async_scheduling = speculative is None and resolve_async_scheduling(self.async_scheduling, device)
        if max_model_len is None:  # only None means "the model's limit"
            max_model_len = model_cfg.max_position_embeddings
        if max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({model_cfg.max_position_embeddings})."
            )
        if draft_cfg is not None and draft_cfg.max_position_embeddings < max_model_len:
            # The draft runs at the target's positions (its RoPE table ends at its own limit): refused
            # here, not as an IndexError once a request grows past it.
            raise ValueError(
                f"The draft model {draft_model!r} (speculative_config['model']) has max_position_embeddings "
                f"{draft_cfg.max_position_embeddings}, below the target {model!r}'s max_model_len {max_model_len}: "
                "it proposes at every position of a request. Pass max_model_len <= "
                f"{draft_cfg.max_position_embeddings}, or a draft model with a longer context."
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}) so that any prompt fits one step."
            )
        config = EngineConfig(
            model_config=ModelConfig(
                model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, batch_invariant=batch_invariant
            ),
            cache_config=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                cache_dtype=self.kv_cache_dtype,
                kv_cache_scales=kv_cache_scales,
                calculate_kv_scales=calculate_kv_scales,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                async_scheduling=async_scheduling,
            ),
            compilation_config=compilation,
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            device=device,
            attention_backend=(
                batch_invariant_backend(batch_invariant, device)
                if self.attention_backend is None
                else self.attention_backend
            ),
            layer_attention_backends=dict(layers or {}),
            speculative_config=speculative,
        )
        return config, model_cfg


def check_speculative_config(value: dict[str, Any] | None, model_cfg: HFConfig) -> SpeculativeConfig | None:
    """`speculative_config` as a checked `SpeculativeConfig` (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            'speculative_config must be a dict such as {"method": "ngram", "num_speculative_tokens": 4} or None, '
            f"got {value!r}."
        )
    known = [f.name for f in fields(SpeculativeConfig)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown}; the keys are {known}.")
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(SPECULATIVE_METHODS)}, got {method!r}.")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (drafts per step, e.g. 4).")
    k = check_int("speculative_config['num_speculative_tokens']", value["num_speculative_tokens"], 1)
    low = check_int("speculative_config['prompt_lookup_min']", value.get("prompt_lookup_min", 1), 1)
    high = check_int("speculative_config['prompt_lookup_max']", value.get("prompt_lookup_max", 4), low)
    draft = value.get("model")
    if method == "ngram":
        if draft is not None:
            raise ValueError("speculative_config['model'] is for method 'draft_model'; 'ngram' proposes without one.")
        return SpeculativeConfig(method, k, low, high)
    if draft is None:
        raise ValueError("speculative_config with method 'draft_model' needs 'model' (a preset name or a directory).")
    draft = check_model(draft, sorted([*PRESETS, *TRAINED_PRESETS]), argument="speculative_config['model']")
    draft_cfg = load_config(draft)
    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise ValueError(
            f"The draft model {draft!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the target "
            f"{model_cfg.vocab_size}: a draft model must share the target's tokenizer."
        )
    return SpeculativeConfig(method, k, model=draft)


def check_kv_cache_scales(value: object, kv_cache_dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """`kv_cache_scales` as {layer name: (k_scale, v_scale)} of positive floats; only with an fp8 cache."""
    if value is None:
        return {}
    check_fp8_cache("kv_cache_scales", kv_cache_dtype)
    example = "{'model.layers.0.self_attn.attn': (0.02, 0.01)}"
    if not isinstance(value, dict):
        raise TypeError(f"kv_cache_scales must map layer names to (k_scale, v_scale), e.g. {example}; got {value!r}.")
    scales = {}
    for name, pair in value.items():
        ok = isinstance(name, str) and isinstance(pair, (tuple, list)) and len(pair) == 2
        # math.isfinite: an inf scale stores every K as 0 and reads it back as 0 * inf = NaN (every request
        # would fail), a NaN scale the same; 0 or a negative scale would divide by 0 or flip the signs.
        if not ok or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in pair
        ):
            raise ValueError(
                f"kv_cache_scales[{name!r}] = {pair!r}: give a layer name and two positive floats (k_scale, "
                f"v_scale), finite (an inf or NaN scale makes every request's logits NaN), e.g. {example}."
            )
        scales[name] = (float(pair[0]), float(pair[1]))
    return scales


def check_fp8_cache(argument: str, kv_cache_dtype: torch.dtype) -> None:
    """Refuse an argument about the fp8 cache's scales (`argument`, as the user wrote it) for another cache."""
    if not is_fp8(kv_cache_dtype):
        raise ValueError(
            f"{argument} is for an fp8 KV cache (kv_cache_dtype='fp8'); this cache stores {kv_cache_dtype}, "
            "which needs no scales."
        )


def env_flag(var: str, default: bool, unset: str) -> bool:
    """$var as a bool: "1" on, "0" off, unset `default` (described by `unset` in the error)."""
    env = os.environ.get(var, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"${var}={env!r}: use 1 (on), 0 (off) or leave it unset ({unset}).")
    return env == "1" if env else default


def resolve_async_scheduling(value: bool | None, device: torch.device) -> bool:
    """The `async_scheduling` argument, or the device's default ($PAGEDKV_ASYNC_SCHEDULING overrides it)."""
    if value is not None:
        return check_bool("async_scheduling", value)
    return env_flag(ASYNC_SCHEDULING_ENV, device.type == "cuda", "on with CUDA")


def resolve_batch_invariant(value: bool | None) -> bool:
    """The `batch_invariant` argument, or $PAGEDKV_BATCH_INVARIANT where it is None."""
    if value is not None:
        return check_bool("batch_invariant", value)
    return env_flag(BATCH_INVARIANT_ENV, False, "off")


def batch_invariant_backend(batch_invariant: bool, device: torch.device) -> str | None:
    """The backend `batch_invariant` picks where none is given: on CUDA the selector would prefer
    FLASH_ATTN, whose kernels choose their splits from the batch; TRITON_ATTN can run without them.
    ($PAGEDKV_ATTENTION_BACKEND still wins, as it does over None.)"""
    if not batch_invariant or device.type != "cuda" or os.environ.get(ATTENTION_BACKEND_ENV):
        return None
    return "TRITON_ATTN"


RESOLVED_AT_START_UP = (
    "device",
    "dtype",
    "max_model_len",
    "cudagraph_mode",
    "compile",
    "async_scheduling",
    "batch_invariant",
)
"""Arguments whose default, None, `create_engine_config` resolves from the model or the machine; the
config field of the same name holds the resolved value (its own default serves configs built by hand)."""

CLI_FLAGS: dict[str, str | None] = {
    "enable_prefix_caching": "--prefix-caching",  # with --no-prefix-caching, the flag the CLI always had
    "seed": None,  # `pagedkv generate --seed` is the sampling seed (SamplingParams.seed)
    "layer_attention_backends": None,  # a dict: Python only
}
"""The command-line flag of the arguments not spelled `--` + the name with dashes; None: no flag."""


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, whitespace collapsed (as vllm/config/utils.py's
    get_attr_docs reads them from the source: Python keeps no attribute docstrings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def engine_args_doc(width: int = 100) -> str:
    """The "Args:" section of `LLM`'s docstring, made from `EngineArgs` itself: each field with its
    default and its docstring, so `help(LLM)` shows what `pagedkv generate --help` shows and neither
    can drift from the fields."""
    docs = attribute_docs(EngineArgs)
    lines = ["Args:"]
    for field in fields(EngineArgs):
        text = f"{field.name} (default {field.default!r}): {docs[field.name]}"
        lines += textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


def cli_flag(name: str) -> str | None:
    """The command-line flag of the `EngineArgs` field `name` (None: it has none)."""
    return CLI_FLAGS.get(name, "--" + name.replace("_", "-"))


def add_cli_args(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """One option per `EngineArgs` field in `names` (`--block-size` for block_size), typed from the
    field's annotation, with the field's default and docstring as its default and help. A bool is a
    pair (`--compile` / `--no-compile`; neither: the field's default)."""
    hints = typing.get_type_hints(EngineArgs)
    docs = attribute_docs(EngineArgs)
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    for name in names:
        flag = cli_flag(name)
        assert flag is not None, f"EngineArgs.{name} has no command-line flag"
        kinds = set(typing.get_args(hints[name]) or [hints[name]]) - {type(None)}
        help_text = docs[name].replace("%", "%%")
        enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
        if enums:
            help_text += f" ({', '.join(enums[0].__members__)}, in any case)"
        kwargs: dict[str, Any] = {"dest": name, "default": defaults[name], "help": help_text}
        if bool in kinds:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif any(typing.get_origin(k) is dict for k in kinds):
            kwargs["type"] = json_object
        else:
            kwargs["type"] = int if int in kinds else float if float in kinds else str
        parser.add_argument(flag, **kwargs)


def json_object(text: str) -> dict[str, Any]:
    """A command-line option's JSON object (argparse reports the ValueError as the option's error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object such as \'{{"method": "ngram"}}\', got {text!r}')
    return value


CLI_ARGS = [f.name for f in fields(EngineArgs) if cli_flag(f.name) is not None]
"""The `EngineArgs` that have a command-line flag, in the order of the fields."""
