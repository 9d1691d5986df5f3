"""The engine tests can fail: two deliberately broken backends, and the scenarios that catch them.

    ZERO_ATTENTION   attention outputs zeros (shapes, cache writes and metadata all normal)
    NO_CACHE_WRITE   do_kv_cache_update does nothing, so attention reads a cache of zeros

Both run the whole engine without an error. The scenarios of tests/engine/test_engine.py,
tests/attention/test_selector.py and tests/kernels/test_kernels.py (backend in the engine) are run with each,
and must fail with the message of their reference check (logits against the float64
transformers model, tests/reference.py): the check, not a side assertion, is what catches them.
The presets' weights also make the greedy tokens themselves change (models/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends.torch_ref import TorchRefBackend, TorchRefImpl
from pagedkv.attention.selector import register_backend, unregister_backend
from tests.attention.test_selector import STUDENT_PROMPTS, run_students_backend
from tests.engine.test_engine import (
    CHUNKED_PROMPTS,
    HYBRID_PROMPTS,
    PREEMPTED_PROMPTS,
    run_chunked_and_whole,
    run_hybrid_small_cache,
    run_preemption,
)
from tests.gpu.test_backends_cuda import PROMPTS as GPU_PROMPTS


class ZeroAttentionImpl(TorchRefImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        return output.zero_()  # the bug: no attention at all


class NoCacheWriteImpl(TorchRefImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        return None  # the bug: new keys and values never reach the cache


class ZeroAttentionBackend(TorchRefBackend):
    @staticmethod
    def get_name() -> str:
        return "ZERO_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type[TorchRefImpl]:
        return ZeroAttentionImpl


class NoCacheWriteBackend(TorchRefBackend):
    @staticmethod
    def get_name() -> str:
        return "NO_CACHE_WRITE"

    @staticmethod
    def get_impl_cls() -> type[TorchRefImpl]:
        return NoCacheWriteImpl


@pytest.fixture(params=[ZeroAttentionBackend, NoCacheWriteBackend], ids=lambda b: b.get_name())
def broken(request: pytest.FixtureRequest) -> Iterator[type[TorchRefBackend]]:
    register_backend(request.param)
    yield request.param
    unregister_backend(request.param.get_name())


def _backend_in_the_engine(backend: str) -> None:
    pytest.importorskip("triton", reason="tests/kernels/test_kernels.py needs the triton package")
    from tests.kernels.test_kernels import run_backend_in_the_engine  # not at the top: it needs triton

    run_backend_in_the_engine(backend)


SCENARIOS: dict[str, Callable[[type[TorchRefBackend]], object]] = {
    "chunked-and-whole": lambda b: run_chunked_and_whole(b.get_name()),
    "preemption": lambda b: run_preemption(b.get_name()),
    "hybrid-small-cache": lambda b: run_hybrid_small_cache(b.get_name()),
    "students-backend": run_students_backend,
    "backend-in-the-engine": lambda b: _backend_in_the_engine(b.get_name()),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reference_check_catches_broken_backend(broken: type[TorchRefBackend], scenario: str) -> None:
    with pytest.raises(AssertionError, match="logits differ from the float64 transformers reference"):
        SCENARIOS[scenario](broken)


def test_broken_backends_change_every_greedy_continuation(broken: type[TorchRefBackend]) -> None:
    """The presets' weights make greedy tokens depend on attention (a token-only check would see it too)."""
    pytest.importorskip("triton", reason="tests/kernels/test_kernels.py needs the triton package")
    from tests.kernels.test_kernels import ENGINE_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt_sets = [  # the scenarios' prompts, and those of tests/gpu/test_backends_cuda.py
        ("tiny", CHUNKED_PROMPTS),
        ("tiny", PREEMPTED_PROMPTS),
        ("tiny-hybrid", HYBRID_PROMPTS),
        ("tiny", STUDENT_PROMPTS),
        ("tiny", ENGINE_PROMPTS),
        ("tiny", GPU_PROMPTS),
    ]
    for model, prompts in prompt_sets:
        good, bad = (
            LLM(model, device="cpu", num_kv_blocks=64, attention_backend=name).generate(prompts, params)
            for name in ("TORCH_REF", broken.get_name())
        )
        same = [g.prompt_token_ids for g, b in zip(good, bad) if g.outputs[0].token_ids == b.outputs[0].token_ids]
        assert not same, f"{broken.get_name()} gives the right greedy tokens for {len(same)} prompt(s) of {model}"
        # What N(0, 0.02) weights did: repeat the prompt's last token whatever attention computes.
        assert all(g.outputs[0].token_ids != g.prompt_token_ids[-1:] * 6 for g in good)
