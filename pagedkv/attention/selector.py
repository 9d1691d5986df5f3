"""Backend selection: a registry by name, and a per-layer choice with reasons.

    layer (head size, dtype, KV cache dtype, block size, type, window, device, MLA or not)
       │
       ├─ explicit name? (LLM(attention_backend=...) or $PAGEDKV_ATTENTION_BACKEND)
       │     -> validate it; if it cannot serve the layer, raise with its reasons
       └─ else the platform's priority list: first backend with no reasons wins;
             if none, raise listing every backend's reasons

Writing your own backend: subclass the trio in `pagedkv.attention.backend`, then
`register_backend(MyBackend)` (add `prefer=True` to try it before the built-in ones).
"""

from __future__ import annotations

import importlib
import os

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionType
from pagedkv.platforms import get_platform

ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"

# Built-in backends are imported only when asked for, so a missing optional package
# (triton, flash-attn) becomes a reason instead of an ImportError at `import pagedkv`.
_BUILTIN: dict[str, str] = {
    "TORCH_REF": "pagedkv.attention.backends.torch_ref:TorchRefBackend",
    "TRITON_ATTN": "pagedkv.attention.backends.triton_attn:TritonAttentionBackend",
    "FLASH_ATTN": "pagedkv.attention.backends.flash_attn:FlashAttentionBackend",
    "TORCH_REF_MLA": "pagedkv.attention.mla.torch_ref_mla:TorchRefMLABackend",
    "TRITON_MLA": "pagedkv.attention.mla.triton_mla:TritonMLABackend",
}
_REGISTRY: dict[str, type[AttentionBackend] | str] = dict(_BUILTIN)
_PREFERRED: list[str] = []


def register_backend(backend: type[AttentionBackend], *, prefer: bool = False) -> type[AttentionBackend]:
    """Add (or replace) a backend under `backend.get_name()`; usable as a class decorator."""
    name = backend.get_name()
    _REGISTRY[name] = backend
    if name in _PREFERRED:
        _PREFERRED.remove(name)
    if prefer:
        _PREFERRED.insert(0, name)
    return backend


def unregister_backend(name: str) -> None:
    """Remove a user backend (built-in names go back to their built-in class)."""
    if name in _BUILTIN:
        _REGISTRY[name] = _BUILTIN[name]
    else:
        _REGISTRY.pop(name, None)
    if name in _PREFERRED:
        _PREFERRED.remove(name)


def registered_backends() -> list[str]:
    return list(_REGISTRY)


def user_backends() -> list[tuple[type[AttentionBackend], bool]]:
    """The registrations made in this process over the built-in ones, as (class, prefer): calling
    `register_backend(cls, prefer=prefer)` in this order rebuilds the same registry in another
    process (a tensor-parallel worker)."""
    added = [
        entry
        for name, entry in _REGISTRY.items()
        if name not in _PREFERRED
        and not isinstance(entry, str)
        and f"{entry.__module__}:{entry.__qualname__}" != _BUILTIN.get(name)
    ]
    return [(cls, False) for cls in added] + [(load_backend(name), True) for name in reversed(_PREFERRED)]


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name` (imports a built-in lazily)."""
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown attention backend {name!r}. Registered backends: {registered_backends()}. "
            "Register your own with pagedkv.attention.selector.register_backend(cls)."
        )
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module_name, cls_name = entry.split(":")
        entry = getattr(importlib.import_module(module_name), cls_name)
        _REGISTRY[name] = entry
    return entry


def backend_reasons(name: str, **layer: object) -> list[str]:
    """Why backend `name` cannot serve a layer described by `layer` (validate_configuration kwargs)."""
    try:
        backend = load_backend(name)
    except ImportError as exc:
        return [f"cannot be imported ({exc})"]
    return backend.validate_configuration(**layer)  # type: ignore[arg-type]


def backend_report(device: torch.device | str, **layer: object) -> dict[str, list[str]]:
    """Every registered backend -> its reasons for rejecting the layer (empty = usable)."""
    layer["device_type"] = torch.device(device).type
    return {name: backend_reasons(name, **layer) for name in registered_backends()}


def get_attn_backend(
    *,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    block_size: int,
    attn_type: AttentionType = AttentionType.DECODER,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    selected: str | None = None,
    layer_name: str = "",
    use_mla: bool = False,
) -> type[AttentionBackend]:
    """Choose the backend class of one layer."""
    platform = get_platform(device)
    layer = dict(
        head_size=head_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        attn_type=attn_type,
        sliding_window=sliding_window,
        device_type=platform.device_type,
        use_mla=use_mla,
    )
    what = (
        f"{'MLA ' if use_mla else ''}layer {layer_name!r} (head size {head_size}, dtype {dtype}, KV cache dtype "
        f"{kv_cache_dtype}, block size {block_size}, sliding window {sliding_window}, "
        f"device {platform.device_type})"
    )
    source = ""  # said when the name comes from the environment, which the caller may not know is set
    if selected is None and os.environ.get(ENV_VAR):
        selected, source = os.environ[ENV_VAR], f" (from ${ENV_VAR})"
    if selected is not None:
        try:
            reasons = backend_reasons(selected, **layer)
        except ValueError as error:  # an unknown name
            raise ValueError(f"{error}{source}") from None
        if reasons:
            raise ValueError(f"Attention backend {selected!r}{source} cannot serve {what}: " + "; ".join(reasons) + ".")
        return load_backend(selected)
    candidates = _PREFERRED + [n for n in platform.backend_priority if n not in _PREFERRED]
    rejected: dict[str, list[str]] = {}
    for name in candidates:
        reasons = backend_reasons(name, **layer)
        if not reasons:
            return load_backend(name)
        rejected[name] = reasons
    lines = "\n".join(f"  {name}: {'; '.join(r)}" for name, r in rejected.items())
    raise ValueError(f"No attention backend can serve {what}:\n{lines}")
