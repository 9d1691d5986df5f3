"""vLLM's block-hash chain beside SGLang's radix tree, on one workload, live (notebook 12).

`compare_prefix_caches(llm, prompts, params)` serves the prompts one after another on a real
engine with prefix caching, whose `KVCacheManager` and `BlockPool` do the chain's lookups and
evictions, and feeds the same token sequences to a `RadixCache` of the same capacity in tokens.
Per request it records the tokens each cache found and the prefixes each evicted, in order:

    request  prompt  chain  radix   evicted by the chain      evicted by the radix tree
    B2           45     32     41   A1 [48:56) A1 [40:48)     A1 [36:52)

The chain's numbers are the engine's own: the hit is the growth of `llm.stats.num_cached_tokens`
while the request ran, and an eviction is a block that held a hash before the request and lost
it (`BlockPool.get_new_blocks` takes blocks off the head of the free queue, so the order is the
free queue's). `plot_prefix_compare` draws the hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from pagedkv import LLM, SamplingParams
from pagedkv.kv_cache.block_pool import BlockHash, BlockPool, hash_request_blocks
from pagedkv.kv_cache.radix_cache import EvictedTokens, RadixCache
from pagedkv.widgets.plots import FACECOLOR, LEGEND_OUTSIDE

CHAIN_COLOR = "#0072B2"
RADIX_COLOR = "#E69F00"


@dataclass
class ServedRequest:
    """One request of the workload as both caches served it."""

    label: str
    token_ids: tuple[int, ...]
    """Its prompt and the outputs whose K/V it computed (all but the last output): what it leaves cached."""
    num_prompt_tokens: int
    chain_hit: int
    radix_hit: int
    chain_evicted: list[EvictedTokens]
    radix_evicted: list[EvictedTokens]


@dataclass
class PrefixComparison:
    """The workload's requests in the order served, and the caches' common size."""

    requests: list[ServedRequest]
    capacity: int
    """Tokens each cache holds: the engine's usable blocks times the block size."""
    block_size: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def chain_hit_rate(self) -> float:
        """Prompt tokens the chain found over all prompt tokens."""
        return sum(r.chain_hit for r in self.requests) / self.num_prompt_tokens

    @property
    def radix_hit_rate(self) -> float:
        return sum(r.radix_hit for r in self.requests) / self.num_prompt_tokens

    def name(self, evicted: EvictedTokens) -> str:
        """`label [start:end)`: the first request whose tokens begin with the evicted prefix."""
        owner = next(r for r in self.requests if r.token_ids[: len(evicted.token_ids)] == evicted.token_ids)
        return f"{owner.label} [{evicted.start}:{len(evicted.token_ids)})"


def _cached_blocks(pool: BlockPool) -> dict[int, BlockHash]:
    return {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}


def compare_prefix_caches(llm: LLM, prompts: Sequence[tuple[str, str]], params: SamplingParams) -> PrefixComparison:
    """Serve `prompts` (label, text) one at a time on `llm` and on a `RadixCache` of the same
    token capacity, both starting empty; each request runs to its end before the next arrives.

    The radix tree reserves a request's tokens when it is admitted, the engine takes blocks step
    by step: with one request at a time both evict the same prefixes for it.
    """
    manager = llm.kv_cache_manager
    if not llm.prefix_caching or len(manager.block_pools) != 1:
        raise ValueError("compare_prefix_caches needs an engine with prefix caching and one KV cache group.")
    pool = manager.block_pools[0]
    if pool.cached_block_hash_to_block:
        raise ValueError("compare_prefix_caches starts from an empty cache: pass a fresh LLM.")
    block_size = manager.specs[0].block_size
    radix = RadixCache(pool.num_usable_blocks * block_size)
    prefix_of: dict[BlockHash, EvictedTokens] = {}  # what each block hash of the workload covers
    served: list[ServedRequest] = []
    for label, text in prompts:
        before = _cached_blocks(pool)
        queue = list(pool.free_queue)  # eviction order: allocations take the head first
        found_before = llm.stats.num_cached_tokens
        (out,) = llm.generate(text, params, use_tqdm=False)
        chain_hit = llm.stats.num_cached_tokens - found_before
        after = _cached_blocks(pool)
        chain_evicted = [prefix_of[before[b]] for b in queue if b in before and after.get(b) != before[b]]

        prompt = out.prompt_token_ids
        token_ids = tuple(prompt + out.outputs[0].token_ids[:-1])  # the last output is never computed
        admitted = radix.start(prompt, len(token_ids))
        if admitted is None:
            raise ValueError(f"request {label} needs {len(token_ids)} tokens, more than the radix tree holds.")
        request, radix_evicted = admitted
        radix.finish(request, token_ids)

        for j, block_hash in enumerate(hash_request_blocks(token_ids, block_size)):
            prefix_of[block_hash] = EvictedTokens(token_ids[: (j + 1) * block_size], j * block_size)
        served.append(
            ServedRequest(label, token_ids, len(prompt), chain_hit, request.num_hit, chain_evicted, radix_evicted)
        )
    return PrefixComparison(served, radix.capacity, block_size)


def plot_prefix_compare(comparison: PrefixComparison, ax: Axes | None = None) -> Axes:
    """Per request: its prompt (grey) and the tokens the chain and the radix tree found in it."""
    if ax is None:
        _fig, ax = plt.subplots(figsize=(7.5, 2.6), layout="constrained", facecolor=FACECOLOR)
    x = range(len(comparison.requests))
    ax.bar(x, [r.num_prompt_tokens for r in comparison.requests], width=0.8, color="#cccccc", label="prompt")
    chain = [r.chain_hit for r in comparison.requests]
    radix = [r.radix_hit for r in comparison.requests]
    ax.bar([i - 0.2 for i in x], chain, width=0.35, color=CHAIN_COLOR, label="found: block-hash chain")
    ax.bar([i + 0.2 for i in x], radix, width=0.35, color=RADIX_COLOR, label="found: radix tree")
    ax.set_xticks(list(x), [r.label for r in comparison.requests])
    ax.set(
        ylabel="tokens",
        title=f"Prompt tokens found: chain {comparison.chain_hit_rate:.0%}, radix tree "
        f"{comparison.radix_hit_rate:.0%} (both {comparison.capacity} tokens)",
    )
    ax.legend(**LEGEND_OUTSIDE)
    return ax
