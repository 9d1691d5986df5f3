"""What the sampler needs of a step, one entry per logits row, and the counter-based noise it draws from.

As vLLM's Model Runner V2 (vllm/v1/worker/gpu/sample/metadata.py, vllm/v1/worker/gpu/sample/gumbel.py),
a row's randomness is not the state of a generator that moves as the row draws, but a pure function of
(the request's seed, the position of the token the row draws, a salt naming the stream): a hash. So the
sampler keeps nothing between steps: nothing to snapshot before a step or restore after an interrupt,
and a request's token at position n is the same whatever batch, chunking, preemption or drafts
came before it.

One uniform per row, read through the inverse CDF of the row's distribution (pagedkv/engine/sampler.py),
rather than vLLM's one Gumbel (or exponential) per row and vocabulary column:

- One hash per row instead of one per vocabulary entry. On the CPU, noise over 151,936 columns x 128
  rows was most of a sampled step's cost (6.2x a greedy step, issue 44), and a seeded row paid it again
  from its own generator.
- With the uniform keyed by (seed, position), the token a row draws is a function of its distribution
  and its position only; a draft token can then be kept iff it equals the token drawn at its position
  (pagedkv/engine/rejection_sampler.py), and a seeded request's tokens are the same with or without drafts.

The runner fills a `SamplingMetadata` from its persistent request state (`RequestStates.sampling_metadata`,
pagedkv/worker/states.py); the engine's sampler reads it. This module imports only torch and numpy: a
lower layer never imports a higher one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TARGET_SALT = 0x3C6EF372FE94F82B
"""The stream the target model's rows draw from (the sampler, the rejection sampler)."""
DRAFT_SALT = 0x1F83D9ABFB41BD6B
"""A sampling draft model's stream: disjoint from the target's, so a draft's draw and the target's draw
at the same position are independent (the draft model proposes greedily today and draws nothing)."""
ENGINE_SEED_SALT = 0x5BE0CD19137E2179
"""The stream an unseeded request's seed comes from: hash(engine seed, arrival number)."""

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 (2^64 / golden ratio) as a wrapped int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


@dataclass
class PenaltyInputs:
    """What presence, frequency and repetition penalties need of the logits rows that have one: each
    row's tokens by position, of which those before the position it draws count (the prompt's for the
    repetition penalty, the output's for all three)."""

    rows: torch.Tensor
    """[m] int64: the logits rows with a penalty (the others are left untouched, bit for bit)."""
    token_ids: torch.Tensor
    """[m, width] int32: each row's request's token at each position (past `positions`: anything)."""
    positions: torch.Tensor
    """[m] int64: the position each row draws: its tokens are those at the positions before it."""
    num_prompt_tokens: torch.Tensor
    """[m] int64: where each row's output starts."""
    presence: torch.Tensor
    """[m] float32: presence penalty (0: none)."""
    frequency: torch.Tensor
    """[m] float32: frequency penalty (0: none)."""
    repetition: torch.Tensor
    """[m] float32: repetition penalty (1: none)."""


@dataclass
class LogitAdjustments:
    """Sparse additions to the logits, one entry each: a logit bias, or -inf on a stop token id while
    the output is shorter than min_tokens. Entry e adds values[e] to logits[rows[e], token_ids[e]] when
    the row draws a position below until[e]."""

    rows: torch.Tensor
    """[n] int64: the logits row of each entry."""
    token_ids: torch.Tensor
    """[n] int64."""
    values: torch.Tensor
    """[n] float32."""
    until: torch.Tensor
    """[n] int64: the entry holds while its row draws a position below this (min_tokens: the prompt's
    length + min_tokens; a bias: always)."""


@dataclass
class SamplingMetadata:
    """A step's sampling parameters as tensors, one entry per logits row, plus host-side summaries that
    let the sampler choose its kernels without reading the device.

    A request has one row, or under speculative decoding 1 + k rows that share its parameters and seed
    and differ in position.
    """

    temperature: torch.Tensor
    """[rows] float32: the temperature each row's logits are divided by; 0.0 marks a greedy row (argmax)."""
    top_k: torch.Tensor
    """[rows] int64: keep the k most likely tokens; 0 keeps all."""
    top_p: torch.Tensor
    """[rows] float32: keep the smallest set of most likely tokens whose probability reaches top_p; 1.0 keeps all."""
    min_p: torch.Tensor
    """[rows] float32: keep tokens at least min_p times as likely as the most likely one; 0.0 keeps all."""
    seeds: torch.Tensor
    """[rows] int64: the seed of the row's request (its own, or one derived from the engine seed)."""
    positions: torch.Tensor
    """[rows] int64: the sequence position of the token the row draws (its input token's position + 1)."""
    all_greedy: bool
    """Every row is greedy: no filter or noise is computed at all."""
    all_random: bool
    """No row is greedy: the argmax over the vocabulary is not computed."""
    max_top_k: int
    """The largest top-k of a sampled row, 0 when no sampled row has one (a top-k >= the vocabulary counts
    as none): the width of the one `topk` that gives top-k rows their candidates."""
    all_top_k: bool
    """Every sampled row has a top-k: no row is sampled over the whole vocabulary."""
    any_top_p: bool
    """Some sampled row has top_p < 1 (otherwise no sort and no cumulative sum for top-p)."""
    any_min_p: bool
    """Some sampled row has min_p > 0."""
    max_num_logprobs: int | None
    """The most logprobs a row asks for; None when no row asks for any."""
    penalties: PenaltyInputs | None = None
    """None when no row has a presence, frequency or repetition penalty: no count is taken."""
    adjustments: LogitAdjustments | None = None
    """None when no row has a logit bias or min_tokens: nothing is added."""

    @classmethod
    def from_rows(
        cls,
        params: torch.Tensor,
        host_params: np.ndarray,
        num_logprobs: np.ndarray,
        seeds: torch.Tensor,
        positions: torch.Tensor,
    ) -> SamplingMetadata:
        """From each row's temperature, top-k, top-p, min-p: `params` [4, rows] on the device (what
        the sampler reads) and `host_params`, the same on the host (what the summaries are taken
        from, so nothing waits for the device); `num_logprobs` [rows] on the host, -1 for none."""
        temperature, top_k, top_p, min_p = host_params
        sampled = temperature > 0
        return cls(
            temperature=params[0],
            top_k=params[1].long(),
            top_p=params[2],
            min_p=params[3],
            seeds=seeds,
            positions=positions,
            all_greedy=not sampled.any(),
            all_random=bool(sampled.all()),
            max_top_k=int(top_k[sampled].max(initial=0)),
            all_top_k=bool((top_k[sampled] > 0).all()),
            any_top_p=bool((top_p[sampled] < 1).any()),
            any_min_p=bool((min_p[sampled] > 0).any()),
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        )


def _logical_right_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >>> bits on int64: torch's `>>` is arithmetic (copies the sign bit), so the bits shifted in
    are masked off."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (Steele, Lea, Flood 2014) in wrapping int64 arithmetic: every input bit
    flips about half the output bits. Multiplication and xor wrap the same way on the CPU and on CUDA,
    so the result is bit-identical on both."""
    x = (x ^ _logical_right_shift(x, 30)) * _MIX1
    x = (x ^ _logical_right_shift(x, 27)) * _MIX2
    return x ^ _logical_right_shift(x, 31)


def _to_int64(value: int) -> int:
    """An integer taken modulo 2^64 as a signed int64 (seeds may be any of [-2^63, 2^64))."""
    return (value + 2**63) % 2**64 - 2**63


def hash64(seeds: torch.Tensor, counters: torch.Tensor, salt: int) -> torch.Tensor:
    """[n] int64: a counter-based hash of (seed, counter, salt), elementwise; counters spaced by the
    golden-ratio constant before the second round, so neighbouring counters land far apart."""
    x = _mix(seeds ^ _to_int64(salt))
    return _mix(x + counters * _GOLDEN)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """[rows] float32 in [0, 1): one uniform per row from hash(seed, position, salt).

    The top 24 bits of the hash, times 2^-24: exact in float32, so the same bits on every device, and
    never 1.0. (24 bits resolve probabilities down to 6e-8, about float32's own rounding of a
    cumulative sum.)"""
    return _logical_right_shift(hash64(seeds, positions, salt), 40).to(torch.float32) * 2.0**-24


def derive_seed(engine_seed: int, number: int) -> int:
    """The sampling seed of an unseeded request: hash(engine seed, its arrival number), so two identical
    unseeded requests draw differently, and an engine run is reproducible from its seed."""
    seed = torch.tensor([_to_int64(engine_seed)], dtype=torch.int64)
    return int(hash64(seed, torch.tensor([number], dtype=torch.int64), ENGINE_SEED_SALT).item())


def seed_as_int64(seed: int) -> int:
    """A request's seed (SamplingParams.seed, any of [-2^63, 2^64)) as the int64 the tensors hold."""
    return _to_int64(seed)
