"""The batched sampler on the GPU: it never waits for the device (async scheduling depends on it),
its draws follow the float64 reference there too, and a seeded request draws the same tokens alone
and in a crowd."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sampler import Sampler
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
    sampler(logits, req_ids, params)  # first call: generators made, kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        output = sampler(logits, req_ids, params).to_host()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = output.rows(req_ids, params)
    assert [t for (t,), _ in rows[0::4]] == logits[0::4].argmax(-1).tolist()
    assert all(lps is not None and len(lps[0]) >= 1 for _, lps in rows[3::4])


@pytest.mark.parametrize("filters", FILTERS[::2])
def test_draws_follow_the_float64_distribution_on_the_gpu(filters: dict) -> None:
    torch.manual_seed(0)
    n = 20000
    params = SamplingParams(**filters)
    tokens = draw(Sampler(), LOGITS.cuda().repeat(n, 1), [str(i) for i in range(n)], [params] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double()
    expected = reference_probs(LOGITS, params) * n
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    assert ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item() < 27.9


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_crowd_on_the_gpu() -> None:
    steps = [torch.randn(4096, device="cuda") for _ in range(5)]
    seeded = SamplingParams(temperature=0.9, top_k=100, seed=21)
    alone, crowd = Sampler(), Sampler()
    a = [draw(alone, x[None], ["r"], [seeded])[0] for x in steps]
    b = [
        draw(crowd, torch.stack([torch.randn(4096, device="cuda"), x]), ["o", "r"], [MIXED[2], seeded])[1]
        for x in steps
    ]
    assert a == b
