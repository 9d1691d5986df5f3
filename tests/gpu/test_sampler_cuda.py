"""The batched sampler on the GPU: it never waits for the device (async scheduling depends on it),
its draws follow the float64 reference there too, its noise is bit for bit the CPU's, and a seeded
request draws the same tokens alone and in a crowd."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler, sampling_metadata
from pagedkv.worker.sampling_metadata import DRAFT_SALT, TARGET_SALT, uniform_noise
from tests.engine.test_sampler import FILTERS, LOGITS, draw, reference_probs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=4),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, min_p=0.1, logprobs=5),
]


def test_sampling_a_batch_never_waits_for_the_gpu() -> None:
    sampler = Sampler()
    logits = torch.randn(256, 151936, device="cuda")
    params = [MIXED[i % len(MIXED)] for i in range(256)]
    req_ids = [str(i) for i in range(256)]
    positions = torch.arange(256, device="cuda") + 7  # as the engine's: read on the device

    def sample() -> object:
        meta = sampling_metadata(params, list(range(256)), positions, 151936, "cuda")
        return sampler(logits, meta).to_host()

    sample()  # first call: kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        output = sample()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = output.rows(req_ids, params)
    assert [t for (t,), _ in rows[0::4]] == logits[0::4].argmax(-1).tolist()
    assert all(lps is not None and len(lps[0]) >= 1 for _, lps in rows[3::4])


def test_the_noise_is_the_cpus_bit_for_bit() -> None:
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 987654321] * 1000)
    positions = torch.arange(len(seeds)) * 7919
    for salt in (TARGET_SALT, DRAFT_SALT):
        cpu = uniform_noise(seeds, positions, salt)
        assert torch.equal(uniform_noise(seeds.cuda(), positions.cuda(), salt).cpu(), cpu)


@pytest.mark.parametrize("filters", FILTERS[::2])
def test_draws_follow_the_float64_distribution_on_the_gpu(filters: dict) -> None:
    n = 20000
    params = SamplingParams(**filters)
    tokens = draw(Sampler(), LOGITS.cuda().repeat(n, 1), [params] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double()
    expected = reference_probs(LOGITS, params) * n
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    assert ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item() < 27.9


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_crowd_on_the_gpu() -> None:
    steps = [torch.randn(4096, device="cuda") for _ in range(5)]
    seeded = SamplingParams(temperature=0.9, top_k=100, seed=21)
    a = [draw(Sampler(), x[None], [seeded], [21], [n])[0] for n, x in enumerate(steps)]
    b = [
        draw(Sampler(), torch.stack([torch.randn(4096, device="cuda"), x]), [MIXED[2], seeded], [5, 21], [3, n])[1]
        for n, x in enumerate(steps)
    ]
    assert a == b
