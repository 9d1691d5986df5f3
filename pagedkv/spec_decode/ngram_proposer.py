"""Prompt lookup: propose a request's next tokens by finding its last few tokens earlier in its own text.

A request that repeats or edits a passage of its prompt (code edits, summaries quoting the source, a
model stuck in a loop) is about to write tokens that already stand in its context. If its last n tokens
occurred before, the tokens that followed them then are a free guess of what follows now: no model
runs, and the target verifies the guess in one pass (after vllm/v1/spec_decode/ngram_proposer.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray,
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    max_new: int | None = None,
) -> list[int]:
    """The tokens that followed the earliest earlier occurrence of the longest matching suffix n-gram.

    For n from `prompt_lookup_max` down to `prompt_lookup_min`, the pattern is the last n tokens;
    the first n with an earlier occurrence (the suffix itself does not count; an occurrence may
    overlap it) wins, and the tokens after that occurrence are proposed: at most
    `num_speculative_tokens`, fewer where the sequence ends, and at most `max_new` when given (the
    request's tokens left before max_tokens or max_model_len). [] when no n matches.

    Earliest, not latest: vLLM takes the earliest occurrence of the longest match (its KMP scan
    over the reversed sequence keeps the last of the longest matches it meets), and so does Hugging
    Face's prompt lookup. The reason shows in a loop: in ``a b c a b c a b c a b c`` the latest
    earlier occurrence of ``c a b c`` ends three tokens before the end, so it can propose only
    ``a b c``; the earliest one leaves six tokens to propose from. On the repeat-a-passage workloads
    prompt lookup is for, the n-gram's first occurrence is in the passage, whose continuation is
    the one wanted.

    Cost: O(len) numpy work, shared by every n: one comparison of the whole sequence with its
    last token finds the candidate occurrences (positions holding that token), then each of the
    other n - 1 tokens of the pattern is checked at the candidates only. A list is first copied
    into an array (about 0.1 ms for 4k tokens, most of the time); pass an int array to skip it.
    """
    tokens = token_ids if isinstance(token_ids, np.ndarray) else np.fromiter(token_ids, np.int64, len(token_ids))
    num_tokens = len(tokens)
    budget = num_speculative_tokens if max_new is None else min(num_speculative_tokens, max_new)
    # An n-gram can occur before the suffix only if the sequence holds at least n + 1 tokens.
    longest = min(prompt_lookup_max, num_tokens - 1)
    if budget <= 0 or longest < prompt_lookup_min:
        return []
    # ends[i]: where a candidate occurrence ends (its last token), before the suffix's own last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return []
    # match[i]: how many of the pattern's tokens, counted back from the last, the candidate agrees on.
    match = np.ones(len(ends), dtype=np.int64)
    agrees = np.ones(len(ends), dtype=bool)
    for back in range(1, longest):
        # ends - back < 0 wraps around, but those candidates are masked out by ends >= back.
        agrees &= (ends >= back) & (tokens[ends - back] == tokens[-1 - back])
        match += agrees
    best = int(match.max())
    if best < prompt_lookup_min:
        return []
    # argmax returns the first True: the earliest occurrence of the longest n-gram.
    start = int(ends[np.argmax(match == best)]) + 1
    return tokens[start : start + budget].tolist()


class NgramProposer:
    """Prompt lookup with one configuration (vLLM's `speculative_config` names): `propose` per request."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}.")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, "
                f"got min={prompt_lookup_min}, max={prompt_lookup_max}."
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_new: int | None = None) -> list[int]:
        """Drafts for one request from its prompt + output tokens so far (see `propose_ngram`)."""
        return propose_ngram(
            token_ids, self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max, max_new
        )
