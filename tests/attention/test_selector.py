"""Backend selection: explicit choice, reasons, the env var, and a student's own backend."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import backend_report, get_attn_backend, register_backend, unregister_backend
from tests.reference import generate_checked

LAYER = dict(head_size=16, dtype=torch.float32, kv_cache_dtype=torch.float32, block_size=16)


def test_cpu_picks_reference() -> None:
    assert get_attn_backend(**LAYER, device="cpu") is TorchRefBackend


def test_unknown_backend_name() -> None:
    with pytest.raises(ValueError, match=r"Unknown attention backend 'NOPE'\. Registered backends: \[.*'TORCH_REF'"):
        get_attn_backend(**LAYER, device="cpu", selected="NOPE")
    with pytest.raises(ValueError, match="Unknown attention backend 'NOPE'"):
        LLM("tiny", device="cpu", attention_backend="NOPE", num_kv_blocks=8)


def test_env_var_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name from the environment says so: the caller may not know the variable is set."""
    monkeypatch.setenv("PAGEDKV_ATTENTION_BACKEND", "MISSING_ONE")
    with pytest.raises(
        ValueError, match=r"Unknown attention backend 'MISSING_ONE'.*\(from \$PAGEDKV_ATTENTION_BACKEND\)"
    ):
        get_attn_backend(**LAYER, device="cpu")
    monkeypatch.setenv("PAGEDKV_ATTENTION_BACKEND", "TRITON_MLA")
    with pytest.raises(ValueError, match=r"'TRITON_MLA' \(from \$PAGEDKV_ATTENTION_BACKEND\) cannot serve layer"):
        get_attn_backend(**LAYER, device="cpu")
    assert get_attn_backend(**LAYER, device="cpu", selected="TORCH_REF") is TorchRefBackend  # an explicit name wins


def test_an_empty_name_is_not_a_backend() -> None:
    """attention_backend="" was taken as "pick one" without a word; None is how to say that."""
    with pytest.raises(ValueError, match="Unknown attention backend ''"):
        LLM("tiny", device="cpu", attention_backend="", num_kv_blocks=8)


class _Picky(TorchRefBackend):
    """A backend with narrow support, to see the selector's reasons."""

    supported_dtypes = (torch.float16,)
    supported_devices = ("cpu",)

    @staticmethod
    def get_name() -> str:
        return "PICKY"

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [32]


@pytest.fixture
def picky():
    register_backend(_Picky)
    yield _Picky
    unregister_backend("PICKY")


def test_explicit_choice_lists_every_reason(picky) -> None:
    with pytest.raises(ValueError) as err:
        get_attn_backend(**LAYER, device="cpu", selected="PICKY", layer_name="model.layers.0.self_attn.attn")
    msg = str(err.value)
    assert "'PICKY' cannot serve layer 'model.layers.0.self_attn.attn'" in msg
    assert "head size 16 not supported (supported: [64, 128])" in msg
    assert "dtype torch.float32 not supported" in msg
    assert "block size 16 not supported" in msg
    with pytest.raises(ValueError, match="head size 16 not supported"):
        LLM("tiny", device="cpu", attention_backend="PICKY", num_kv_blocks=8)


def test_no_backend_at_all_lists_each() -> None:
    with pytest.raises(ValueError, match=r"No attention backend can serve .*\n  TORCH_REF: device 'xpu' not supported"):
        get_attn_backend(**LAYER, device="xpu")


def test_report_has_every_backend(picky) -> None:
    report = backend_report("cpu", **LAYER)
    assert report["TORCH_REF"] == []
    assert len(report["PICKY"]) == 3
    assert set(report) >= {"TORCH_REF", "TRITON_ATTN", "FLASH_ATTN", "PICKY"}
    assert report["FLASH_ATTN"], "FLASH_ATTN must say why it cannot run on the CPU"


STUDENT_PROMPTS = [{"prompt_token_ids": [4, 5, 6]}]


def run_students_backend(base: type[AttentionBackend] = TorchRefBackend) -> list[int]:
    """Register COUNTING (`base` with a call-counting impl), generate through it and check the
    logits against the float64 reference; returns the query length of every forward call."""
    calls: list[int] = []

    class CountingImpl(base.get_impl_cls()):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
            calls.append(query.shape[0])
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)

    @register_backend
    class Counting(base):
        @staticmethod
        def get_name() -> str:
            return "COUNTING"

        @staticmethod
        def get_impl_cls():
            return CountingImpl

    try:
        llm = LLM("tiny", device="cpu", attention_backend="COUNTING", num_kv_blocks=8)
        generate_checked(llm, STUDENT_PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        unregister_backend("COUNTING")
    return calls


def test_students_backend_is_used_by_the_engine() -> None:
    calls = run_students_backend()
    assert calls[:4] == [3, 3, 3, 3] and len(calls) == 4 * 3  # 4 layers x 3 steps (num_kv_blocks given: no profile run)


class _FromScratch(AttentionBackend):
    """A backend written from the base class, as the README's recipe starts: it keeps the default
    supported_devices, ("cuda",)."""

    @staticmethod
    def get_name() -> str:
        return "FROM_SCRATCH"

    @staticmethod
    def get_impl_cls():
        return TorchRefBackend.get_impl_cls()

    @staticmethod
    def get_builder_cls():
        return TorchRefBackend.get_builder_cls()


def test_a_backend_left_cuda_only_by_default_is_told_the_setting() -> None:
    """Before, the CPU refusal said only "device 'cpu' not supported (needs one of ['cuda'])": a writer
    who never set supported_devices could not tell where that came from."""
    reasons = _FromScratch.validate_configuration(**LAYER, device_type="cpu")
    assert (
        "device 'cpu' not supported (needs one of ['cuda']); _FromScratch inherits "
        "AttentionBackend.supported_devices = ('cuda',): set supported_devices = ('cuda', 'cpu') on the class "
        "if it runs there"
    ) in reasons
    # Setting it as the message says makes the device reason go (the class then serves the layer on the CPU).
    fixed = type("Fixed", (_FromScratch,), {"supported_devices": ("cuda", "cpu")})
    assert fixed.validate_configuration(**LAYER, device_type="cpu") == []
    # A backend that chose CUDA only itself (FLASH_ATTN) is not told to change it.
    assert not any("inherits" in r for r in _Picky.validate_configuration(**LAYER, device_type="cuda"))
