"""`compare_prefix_caches` (notebook 12, section 8): the chain's numbers are the live engine's own
(its prefix-cache stats, the admitted requests' records, the pool's hashes), and both caches'
hits match longest common prefixes worked out by brute force when nothing is evicted."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv_cache.block_pool import hash_request_blocks
from pagedkv.trace import RequestRecord, StepTrace
from pagedkv.widgets.prefix_compare import PrefixComparison, compare_prefix_caches, plot_prefix_compare

A = "You are a helpful Python tutor. "
B = "You are a terse code reviewer. "
C = "Answer in one short sentence. "
WORKLOAD = [
    ("A1", A + "What is a list?"),
    ("A2", A + "What is a dict?"),
    ("B1", B + "Review: x=1"),
    ("C1", C + "What is pip?"),
    ("A3", A + "What is a set?"),
    ("B2", B + "Review: y=2"),
    ("C2", C + "What is a venv?"),
    ("A4", A + "Explain for."),
    ("B3", B + "Review: x=1"),
    ("A5", A + "What is a list?"),
]
"""Notebook 12's workload: three system prompts, ten turns."""
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BS = 8


def serve(num_kv_blocks: int) -> tuple[LLM, StepTrace, PrefixComparison]:
    llm = LLM("tiny-pydoc", device="cpu", block_size=BS, num_kv_blocks=num_kv_blocks, attention_backend="TORCH_REF")
    with StepTrace.attach(llm) as trace:
        comparison = compare_prefix_caches(llm, WORKLOAD, PARAMS)
    return llm, trace, comparison


@pytest.fixture(scope="module")
def tight() -> tuple[LLM, StepTrace, PrefixComparison]:
    """The notebook's run: 19 usable blocks of 8, too few for the whole workload."""
    return serve(20)


def test_the_chain_numbers_are_the_engines_prefix_cache_stats(tight: tuple[LLM, StepTrace, PrefixComparison]) -> None:
    llm, trace, comparison = tight
    assert comparison.capacity == 19 * BS
    assert comparison.num_prompt_tokens == llm.stats.num_lookup_tokens
    assert sum(r.chain_hit for r in comparison.requests) == llm.stats.num_cached_tokens
    assert comparison.chain_hit_rate == llm.stats.prefix_cache_hit_rate
    # Request by request: what the scheduler recorded when it admitted each one.
    first_steps: dict[str, RequestRecord] = {}  # each request in the step that admitted it
    for record in trace:
        for r in record.requests:
            first_steps.setdefault(r.req_id, r)
    assert [(r.num_prompt_tokens, r.num_cached_tokens) for r in first_steps.values()] == [
        (r.num_prompt_tokens, r.chain_hit) for r in comparison.requests
    ]


def test_the_tight_cache_evicts_and_the_two_caches_differ(tight: tuple[LLM, StepTrace, PrefixComparison]) -> None:
    llm, _, comparison = tight
    pool = llm.kv_cache_manager.block_pools[0]
    chain = [e for r in comparison.requests for e in r.chain_evicted]
    assert chain and any(r.radix_evicted for r in comparison.requests)
    for evicted in chain:  # whole blocks of prefixes that an earlier request cached
        assert evicted.start % BS == 0 and evicted.num_tokens == BS
        comparison.name(evicted)  # raises StopIteration if no request holds that prefix
    for evicted in comparison.requests[-1].chain_evicted:  # nothing ran after: still gone
        assert pool.get_cached_block(hash_request_blocks(evicted.token_ids, BS)[-1]) is None
    # A2 shares "...tutor. What is a " (43 tokens) with A1: the tree reuses them all, the chain
    # the 40 of five full blocks.
    a2 = comparison.requests[1]
    assert (a2.chain_hit, a2.radix_hit) == (40, 43)


def chain_by_hand(
    sequences: list[tuple[int, tuple[int, ...]]], num_blocks: int
) -> list[tuple[int, list[tuple[int, ...]]]]:
    """The chain worked out from its rules alone, for requests served one at a time: (prompt
    length, tokens cached) -> per request, the tokens found and the prefixes whose last block was
    evicted, in order."""
    free = list(range(1, num_blocks))  # the free queue, head first
    refs = [0] * num_blocks
    prefix_of: dict[int, tuple[int, ...]] = {}
    block_of: dict[tuple[int, ...], int] = {}
    out = []
    for num_prompt, tokens in sequences:
        row = []
        for j in range((num_prompt - 1) // BS):  # never the block of the last prompt token
            block = block_of.get(tokens[: (j + 1) * BS])
            if block is None:
                break
            if refs[block] == 0:
                free.remove(block)
            refs[block] += 1
            row.append(block)
        hit, evicted = len(row) * BS, list[tuple[int, ...]]()
        while len(row) * BS < len(tokens):
            block = free.pop(0)
            if block in prefix_of:
                lost = prefix_of.pop(block)
                del block_of[lost]
                evicted.append(lost)
            refs[block] = 1
            row.append(block)
        for j, block in enumerate(row[: len(tokens) // BS]):
            prefix = tokens[: (j + 1) * BS]
            if block not in prefix_of and prefix not in block_of:
                prefix_of[block], block_of[prefix] = prefix, block
        for block in reversed(row):  # last block first
            refs[block] -= 1
            if refs[block] == 0:
                free.append(block)
        out.append((hit, evicted))
    return out


@pytest.mark.parametrize("num_kv_blocks", [16, 20])
def test_the_chain_hits_and_evictions_follow_its_rules_worked_by_hand(num_kv_blocks: int) -> None:
    comparison = serve(num_kv_blocks)[2]
    expected = chain_by_hand([(r.num_prompt_tokens, r.token_ids) for r in comparison.requests], num_kv_blocks)
    assert [(r.chain_hit, [e.token_ids for e in r.chain_evicted]) for r in comparison.requests] == expected
    if num_kv_blocks == 16:  # some request evicts several blocks: their order is checked too
        assert max(len(evicted) for _, evicted in expected) > 1


def test_without_evictions_both_hits_are_the_longest_common_prefix() -> None:
    _, _, comparison = serve(64)
    served: list[tuple[int, ...]] = []
    for r in comparison.requests:
        assert r.chain_evicted == [] and r.radix_evicted == []
        prompt = r.token_ids[: r.num_prompt_tokens]
        common = 0
        for earlier in served:
            n = 0
            while n < min(len(earlier), len(prompt)) and earlier[n] == prompt[n]:
                n += 1
            common = max(common, n)
        usable = min(common, len(prompt) - 1)  # the last prompt token is always computed
        assert r.radix_hit == usable
        assert r.chain_hit == usable // BS * BS
        served.append(r.token_ids)


def test_the_plot_shows_both_hit_rates(tight: tuple[LLM, StepTrace, PrefixComparison]) -> None:
    comparison = tight[2]
    ax = plot_prefix_compare(comparison)
    assert f"chain {comparison.chain_hit_rate:.0%}" in ax.get_title()
    assert f"radix tree {comparison.radix_hit_rate:.0%}" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == [label for label, _ in WORKLOAD]
    assert len(ax.patches) == 3 * len(WORKLOAD)  # prompt, chain, tree: one bar each per request


def test_a_used_cache_is_refused() -> None:
    llm = LLM("tiny-pydoc", device="cpu", block_size=BS, num_kv_blocks=16, attention_backend="TORCH_REF")
    llm.generate(A + "Hi there, this is long.", PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="starts from an empty cache"):
        compare_prefix_caches(llm, WORKLOAD[:1], PARAMS)
