"""Argument checks for `SamplingParams` and `LLM` that know the engine: token ids, models,
devices, dtypes, compilation and tensor parallelism. The generic int / float / bool checks
live in `pagedkv.checks`.
"""

from __future__ import annotations

import os
import reprlib

import torch

from pagedkv.checks import check_bool, check_float, check_int, check_optional_int, describe
from pagedkv.config import CompilationConfig, CUDAGraphMode, parse_dtype
from pagedkv.models.layers import head_layout
from pagedkv.models.loader import HFConfig, resolve_model
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.platforms import default_device

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_token_ids(name: str, value: object) -> list[int]:
    """A list or tuple of token ids (ints >= 0) as a list of Python ints."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be a list of token ids (ints), got {describe(value)}. Write [5] for a single id; "
            "convert an array with .tolist()."
        )
    checked = []
    for i, token in enumerate(value):
        try:
            checked.append(check_int(f"{name}[{i}]", token, low=0))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} must be a list of ints >= 0, got {reprlib.repr(value)}: {e}") from None
    return checked


def check_stop_strings(value: object) -> list[str]:
    """`SamplingParams.stop`: None, one string, or a list of non-empty strings, as a list."""
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop must be a string, a list of strings or None, got {describe(value)}.")
    if any(s == "" for s in strings):
        raise ValueError(f"stop strings must not be empty (an empty string matches at once), got {strings!r}.")
    return list(strings)


LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""Biases taken, as OpenAI's API takes them."""


def check_logit_bias(value: object) -> dict[int, float] | None:
    """`SamplingParams.logit_bias`: None, or a dict of token id (an int >= 0, or its decimal string as
    JSON keys are) -> a finite number in LOGIT_BIAS_RANGE."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, or None, got {describe(value)}.")
    checked = {}
    try:
        for key, bias in value.items():
            token = check_int("a token id", int(key) if isinstance(key, str) and key.isdigit() else key, 0)
            checked[token] = check_float(f"the bias of token {token}", bias, *LOGIT_BIAS_RANGE)
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"logit_bias maps token ids (ints >= 0) to numbers in [-100, 100], got {reprlib.repr(value)}: {e}"
        ) from None
    return checked


def check_prompt(prompt: object, tokenizer: Tokenizer | None, model: str, vocab_size: int) -> list[int]:
    """A prompt's token ids: text (encoded by `tokenizer`) or {"prompt_token_ids": [...]}, each id
    below the model's `vocab_size`."""
    if isinstance(prompt, dict):
        if set(prompt) != {"prompt_token_ids"}:
            raise ValueError(f"A dict prompt has the one key 'prompt_token_ids', got keys {sorted(map(str, prompt))}.")
        token_ids = check_token_ids("prompt_token_ids", prompt["prompt_token_ids"])
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"Model {model!r} has no tokenizer; pass {{'prompt_token_ids': [...]}} instead of a string."
            )
        try:
            token_ids = tokenizer.encode(prompt)
        except UnicodeError as error:  # lone surrogates, say: the tokenizer takes UTF-8 text
            raise ValueError(f"The prompt cannot be encoded as UTF-8: {error}.") from None
    else:
        raise TypeError(f"A prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}.")
    if any(t >= vocab_size for t in token_ids):
        raise ValueError(f"Prompt token ids must be in [0, {vocab_size}) for this model, got {max(token_ids)}.")
    return token_ids


def check_model(model: object, presets: list[str], argument: str = "model") -> str:
    """A preset name or a directory path (str or os.PathLike) as a str; a model directory named
    like a preset wins over it (`resolve_model`)."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise TypeError(
            f"{argument} must be a preset name ({', '.join(presets)}) or the path of a Hugging Face "
            f"model directory, got {model!r} ({type(model).__name__})."
        )
    return resolve_model(model)


def check_device(device: object) -> torch.device:
    """None picks CUDA when a GPU is visible, else the CPU; a CUDA device must exist."""
    if device is None:
        device = default_device()
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', a torch.device or None, got {device!r}.")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device torch knows; use 'cpu', 'cuda' or 'cuda:N'.") from None
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch accepts any index, but the CPU is one device
            raise ValueError(f'device={str(device)!r}: there is one CPU device; use device="cpu".')
        return torch.device("cpu")
    if device.type != "cuda":  # the kernels and backends here are written for these two
        raise ValueError(
            f"device={str(device)!r}: pagedkv runs on 'cpu' or 'cuda' devices; leave device=None to pick one."
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} was asked for, but no CUDA device is visible to torch "
            '(torch.cuda.is_available() is False); use device="cpu", or leave device=None to pick one.'
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
    return torch.device("cuda", index)


def check_dtype(dtype: object, device: torch.device) -> torch.dtype:
    """None: float32 on the CPU (fast and exact there), bfloat16 on a GPU."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be a name such as 'bfloat16', a torch.dtype or None, got {dtype!r}.")
    dtype = parse_dtype(dtype)
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype} cannot hold model weights here; use one of {list(MODEL_DTYPES)}.")
    return dtype


def check_cudagraph_mode(value: object) -> CUDAGraphMode:
    """A `CUDAGraphMode` or its name in any case ("full_decode_only")."""
    if not isinstance(value, (CUDAGraphMode, str)):
        raise TypeError(
            f"cudagraph_mode must be a CUDAGraphMode or one of its names ({', '.join(CUDAGraphMode.__members__)}), "
            f"got {describe(value)}."
        )
    return CUDAGraphMode.parse(value)


DEFAULT_CUDA_CUDAGRAPH_MODE = CUDAGraphMode.FULL_AND_PIECEWISE
"""The mode a CUDA engine runs when none is given (with compile on), as in vLLM."""


def check_compilation(
    cudagraph_mode: object,
    enforce_eager: object,
    compile: object,
    max_cudagraph_capture_size: object,
    device: torch.device,
    tensor_parallel_size: int,
    batch_invariant: bool = False,
) -> CompilationConfig:
    """`LLM`'s CUDA graph and torch.compile arguments, checked, as a `CompilationConfig`.

    None picks the device's default, as vllm/config/vllm.py (VllmConfig.__post_init__) does: on
    CUDA without `enforce_eager`, compile on and FULL_AND_PIECEWISE; otherwise eager (NONE, no
    compile). Explicit values are kept (and checked against tensor parallelism later). The
    batch-invariant mode runs uncompiled unless compile=True is given: its matmuls, norms and
    attention are opaque ops (pagedkv/batch_invariant.py), so Inductor fuses only the elementwise
    work between them, but that it keeps every bit is shown on the CPU only so far.
    """
    enforce_eager = check_bool("enforce_eager", enforce_eager)
    fast = device.type == "cuda" and not enforce_eager
    if compile is None:
        # With tensor_parallel_size > 1 the ranks capture whole-model graphs only
        # (check_tensor_parallel), so the default leaves the compile out there.
        compile = fast and tensor_parallel_size == 1 and not batch_invariant
    compile = check_bool("compile", compile)
    if cudagraph_mode is None:
        # Without the compile there are no piecewise graphs: mixed batches run eagerly and decodes
        # keep their full graphs (FULL_DECODE_ONLY), the lowering resolve_cudagraph_mode would
        # apply at start-up, applied here so that a default never warns or is refused.
        default = DEFAULT_CUDA_CUDAGRAPH_MODE if fast else CUDAGraphMode.NONE
        cudagraph_mode = default if compile else default.without_piecewise()
    return CompilationConfig(
        cudagraph_mode=check_cudagraph_mode(cudagraph_mode),
        enforce_eager=enforce_eager,
        compile=compile,
        max_cudagraph_capture_size=check_optional_int(
            "max_cudagraph_capture_size", max_cudagraph_capture_size, 1, hint=" (tokens) or None"
        ),
    )


def check_tensor_parallel(tp_size: int, model: HFConfig, device: torch.device, compilation: CompilationConfig) -> None:
    """Whether `model` can be split `tp_size` ways here (checked before any process starts)."""
    if tp_size == 1:
        return
    if not model.supports_tensor_parallel:
        raise NotImplementedError(
            f"tensor_parallel_size={tp_size}: {model.architecture} models run on one rank only here (their "
            "attention heads and experts are not split over ranks); use tensor_parallel_size=1."
        )
    assert model.num_key_value_heads is not None  # LlamaConfig.__post_init__ fills it in
    head_layout(model.num_attention_heads, model.num_key_value_heads, tp_size)  # raises naming the heads
    if model.intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({model.intermediate_size}) must be divisible by tensor_parallel_size ({tp_size}): "
            "each rank holds an equal share of the MLP."
        )
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs {tp_size} GPUs (one per rank); {torch.cuda.device_count()} "
            "visible (CUDA_VISIBLE_DEVICES)."
        )
    if compilation.compile or compilation.cudagraph_mode.requires_piecewise_compilation():
        raise NotImplementedError(
            f"tensor_parallel_size={tp_size} captures whole-model CUDA graphs only (the all-reduces are "
            f"captured with the rest): pass cudagraph_mode 'FULL', 'FULL_DECODE_ONLY' or 'NONE' and compile=False, "
            f"or leave both None "
            f"(got cudagraph_mode={compilation.cudagraph_mode.name}, compile={compilation.compile})."
        )
