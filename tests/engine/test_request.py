"""Requests by hand: when a request stops, and which temperatures count as greedy."""

from __future__ import annotations

from pagedkv import SamplingParams
from pagedkv.engine.request import SAMPLING_EPS, Request


def _request(**params: object) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), eos_token_ids=[9])


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    """ignore_eos only concerns the model's EOS ids; a user's stop_token_ids still stop
    (vLLM checks them regardless of ignore_eos)."""
    req = _request(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    req.append_output_token_id(9)  # EOS, ignored
    assert not req.check_stop(max_model_len=100)
    req.append_output_token_id(7)
    assert req.check_stop(max_model_len=100) and req.finish_reason == "stop"


def test_greedy_threshold_is_strictly_below_sampling_eps() -> None:
    """ "anything below SAMPLING_EPS (1e-5)" is greedy; SAMPLING_EPS itself samples (and
    so draws from the request's or the global generator), as vLLM's `temperature < _SAMPLING_EPS`."""
    assert SamplingParams(temperature=SAMPLING_EPS * 0.999).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
