"""The KV cache manager: blocks per request, per KV cache group.

Each group has its own pool (its own backing buffer) and its own block list per request.
A request that has computed `num_computed_tokens` and will compute `num_new_tokens` more
needs `ceil((num_computed_tokens + num_new_tokens) / block_size)` blocks in every group:

    tokens:  [0 ........ 15][16 ....... 31][32 .. 37      ]     38 tokens, block_size 16
    blocks:  [     7       ][     2       ][     9        ]     3 blocks; waste only in the last

Sliding-window groups give back blocks that fell out of the window and put the null
block (id 0) in their place, so the block table keeps its logical positions.
"""

from __future__ import annotations

from pagedkv.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec


class KVCacheManager:
    """Allocates and frees the blocks of requests in every KV cache group."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        self.specs: list[KVCacheSpec] = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.block_pools = [BlockPool(kv_cache_config.num_blocks) for _ in self.specs]
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at most, in its hungriest group."""
        return max(spec.blocks_needed(num_tokens) for spec in self.specs)

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pools[0].num_usable_blocks

    def num_free_blocks(self, group: int = 0) -> int:
        return self.block_pools[group].num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks in use, the fullest group counting."""
        return max(pool.get_usage() for pool in self.block_pools)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's block table row (physical block ids, 0 = null block)."""
        return [[b.block_id for b in blocks] for blocks in self.req_to_blocks.get(request_id, [])]

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and nothing changed) if it does not fit."""
        rows = self.req_to_blocks.setdefault(request_id, [[] for _ in self.specs])
        for spec, pool, row in zip(self.specs, self.block_pools, rows):
            self._free_out_of_window(spec, pool, row, num_computed_tokens)
        total = num_computed_tokens + num_new_tokens
        needed = [spec.blocks_needed(total) - len(row) for spec, row in zip(self.specs, rows)]
        if any(n > pool.num_free_blocks for n, pool in zip(needed, self.block_pools)):
            return False
        for n, pool, row in zip(needed, self.block_pools, rows):
            if n > 0:
                row.extend(pool.get_new_blocks(n))
        return True

    def free(self, request_id: str) -> None:
        """Give back every block of a finished or preempted request (last block first)."""
        for pool, row in zip(self.block_pools, self.req_to_blocks.pop(request_id, [])):
            pool.free_blocks(list(reversed(row)))

    @staticmethod
    def _free_out_of_window(
        spec: KVCacheSpec, pool: BlockPool, row: list[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """Swap blocks that no query of this step can see for the null block."""
        if not isinstance(spec, SlidingWindowSpec):
            return
        # The earliest query of the step sits at position num_computed_tokens and sees
        # keys p with num_computed_tokens - p < window.
        first_visible = max(num_computed_tokens - spec.sliding_window + 1, 0)
        for j in range(min(first_visible // spec.block_size, len(row))):
            if row[j] is not pool.null_block:
                pool.free_blocks([row[j]])
                row[j] = pool.null_block
