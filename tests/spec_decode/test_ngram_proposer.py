"""Prompt lookup by hand: which n-gram matches, which occurrence, how many tokens; and against a brute force."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.spec_decode.ngram_proposer import NgramProposer, propose_ngram

# "2 3" first occurs at 1..2 (then 6 6), "1 2 3" at 5..7 (then 7 8); the sequence ends in "1 2 3".
SEQ = [5, 2, 3, 6, 6, 1, 2, 3, 7, 8, 1, 2, 3]


def brute_force(tokens: list[int], k: int, lo: int, hi: int, max_new: int | None) -> list[int]:
    """The definition, spelled out: for n = hi .. lo, every earlier start position from the first."""
    budget = k if max_new is None else min(k, max_new)
    for n in range(hi, lo - 1, -1):
        pattern = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n):  # the suffix itself starts at len - n
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + budget] if budget > 0 else []
    return []


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        (1, 3, [7, 8]),  # the 3-gram "1 2 3" matches: the longest n wins
        (1, 2, [6, 6]),  # only up to 2-grams: "2 3", first seen at 1..2
        (1, 1, [6, 6]),  # "3", first seen at 2
        (3, 3, [7, 8]),
        (4, 5, []),  # "8 1 2 3" and "7 8 1 2 3" occur nowhere else
    ],
)
def test_longest_n_wins_then_earliest_occurrence(lo: int, hi: int, expected: list[int]) -> None:
    assert propose_ngram(SEQ, 2, lo, hi) == expected


def test_no_match_and_too_short() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []
    assert propose_ngram([], 3, 1, 4) == []
    assert propose_ngram([7], 3, 1, 4) == []  # a one-token sequence has no earlier occurrence
    assert propose_ngram([7, 7], 3, 2, 4) == []  # a 2-gram needs 3 tokens


def test_continuation_stops_where_the_sequence_ends() -> None:
    # "1 2" first at 0..1; after it only 9 1 2 remain (the occurrence's continuation runs into the suffix).
    assert propose_ngram([1, 2, 9, 1, 2], 5, 1, 4) == [9, 1, 2]
    # An occurrence may overlap the suffix: "7 7" at 0..1, the suffix at 1..2.
    assert propose_ngram([7, 7, 7], 4, 1, 2) == [7]


def test_earliest_occurrence_in_a_loop() -> None:
    """In a loop the earliest occurrence leaves k tokens to propose; the latest would leave 3."""
    assert propose_ngram([1, 2, 3] * 4, 4, 1, 4) == [1, 2, 3, 1]


def test_max_new_caps_the_proposal() -> None:
    assert propose_ngram(SEQ, 2, 1, 3, max_new=1) == [7]
    assert propose_ngram(SEQ, 2, 1, 3, max_new=5) == [7, 8]
    assert propose_ngram(SEQ, 2, 1, 3, max_new=0) == []
    assert propose_ngram(SEQ, 0, 1, 3) == []


def test_matches_a_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat n-grams often
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        max_new = rng.choice([None, 0, 1, 3, 10])
        expected = brute_force(tokens, k, lo, hi, max_new)
        assert propose_ngram(tokens, k, lo, hi, max_new) == expected, (tokens, k, lo, hi, max_new)
        assert propose_ngram(np.array(tokens, dtype=np.int32), k, lo, hi, max_new) == expected


def test_proposer_holds_the_config() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose(SEQ) == [7, 8]
    assert proposer.propose(SEQ, max_new=1) == [7]
    for bad in [dict(num_speculative_tokens=0), dict(prompt_lookup_min=0), dict(prompt_lookup_min=4)]:
        with pytest.raises(ValueError, match="num_speculative_tokens|prompt_lookup"):
            NgramProposer(**{"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **bad})
