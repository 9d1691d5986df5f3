"""The KV cache manager: blocks per request, per KV cache group.

Each group has its own pool (its own backing buffer) and its own block list per request.
A request that has computed `num_computed_tokens` and will compute `num_new_tokens` more
needs `ceil((num_computed_tokens + num_new_tokens) / block_size)` blocks in every group:

    tokens:  [0 ........ 15][16 ....... 31][32 .. 37      ]     38 tokens, block_size 16
    blocks:  [     7       ][     2       ][     9        ]     3 blocks; waste only in the last

Sliding-window groups give back blocks that fell out of the window and put the null
block (id 0) in their place, so the block table keeps its logical positions.

With prefix caching, every full block gets a hash chained from its parent's (block_pool.py),
and a new request starts with the blocks whose hashes are cached already:

    request B:  [ same 16 tokens as A ][ same 16 as A ][ B's own ...  ]
    hashes:     h0 = H(None, t0:16)     h1 = H(h0, t16:32)  h2 (a miss)
    blocks:     A's block 7 (ref 2)     A's block 2 (ref 2) new block 11
                |---- num_computed_tokens = 32: not run again ----|

A block is hashed when the step that fills it is planned, as vLLM's `allocate_slots` does
(vllm/v1/core/kv_cache_manager.py), so a request admitted later in the same step can already
share it: every layer writes the step's K/V before any of its tokens attends. The hash is then
a promise that the step will write the block. vLLM's engine core dies with a failed step, so it
never meets a broken promise; this engine lives on after an exception or a Ctrl-C in the middle
of a forward. So the hashes a plan adds stay pending until the step has run: `commit()` keeps
them, `rollback()` takes them back, and no later step can find a block whose K/V were never
written.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_request_blocks
from pagedkv.kv_cache.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec


class KVCacheManager:
    """Allocates and frees the blocks of requests in every KV cache group, and finds cached prefixes."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = False) -> None:
        self.kv_cache_config = kv_cache_config
        self.specs: list[KVCacheSpec] = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        if enable_caching and any(isinstance(spec, SlidingWindowSpec) for spec in self.specs):
            raise ValueError(
                "Prefix caching is not supported with sliding-window layers (their blocks leave the window); "
                "turn it off (enable_prefix_caching=False)."
            )
        self.enable_caching = enable_caching
        self._windowed = any(isinstance(spec, SlidingWindowSpec) for spec in self.specs)
        """Some group gives back blocks behind its window (so no step may skip that check)."""
        self.block_pools = [BlockPool(kv_cache_config.num_blocks) for _ in self.specs]
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        """The hashes of each request's full blocks so far (the same in every group: one block size)."""
        self.num_cached_blocks: dict[str, int] = {}
        """How many of each request's leading blocks have been offered to the cache already."""
        self._pending: list[tuple[BlockPool, KVCacheBlock, BlockHash]] = []
        """Blocks hashed since the last commit (the step that writes them has not finished)."""
        self._pending_num_cached: dict[str, int] = {}
        """`num_cached_blocks` of each request as it was at the last commit, for a rollback."""

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

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest cached prefix of a request that holds no blocks yet: per group, the cached
        blocks, and how many tokens they cover (a multiple of the block size).

        Never the whole sequence: the last token is always computed, so that the step has its
        logits to sample from. A prefix counts only if every group has all of its blocks.
        """
        if not self.enable_caching:
            return [[] for _ in self.specs], 0
        hashes = self._block_hashes(request_id, token_ids, len(token_ids))
        block_size = self.specs[0].block_size
        usable = hashes[: (len(token_ids) - 1) // block_size]
        hits: list[list[KVCacheBlock]] = []
        for pool in self.block_pools:
            blocks = []
            for block_hash in usable:
                block = pool.get_cached_block(block_hash)
                if block is None:
                    break
                blocks.append(block)
            hits.append(blocks)
        n = min(len(blocks) for blocks in hits)
        return [blocks[:n] for blocks in hits], n * block_size

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and nothing changed) if it does not fit.

        `new_computed_blocks` (from `get_computed_blocks`, for a request without blocks) are
        shared, not allocated: they hold its first `num_computed_tokens` tokens. With prefix
        caching, `token_ids` (the request's tokens so far) lets every block that this step
        fills up be cached.
        """
        rows = self.req_to_blocks.setdefault(request_id, [[] for _ in self.specs])
        total = num_computed_tokens + num_new_tokens
        # Most steps are decodes whose token fits the blocks the request holds: nothing to allocate.
        fits = (
            not new_computed_blocks
            and not self._windowed
            and all(len(row) * spec.block_size >= total for spec, row in zip(self.specs, rows))
        )
        if not fits and not self._allocate(rows, num_computed_tokens, total, new_computed_blocks):
            return False
        if self.enable_caching and token_ids is not None:
            # Only blocks of known tokens: under async scheduling the step's last token may be
            # one the host has not read yet (its block is hashed by a later call).
            self._cache_full_blocks(request_id, token_ids, min(total, len(token_ids)))
        return True

    def _allocate(
        self,
        rows: list[list[KVCacheBlock]],
        num_computed_tokens: int,
        total: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None,
    ) -> bool:
        """Per group: drop blocks behind the window, then share the hits and take new blocks up to
        `total` tokens; False (and nothing changed but the dropped blocks) if they do not fit."""
        hits = new_computed_blocks or [[] for _ in self.specs]
        for spec, pool, row in zip(self.specs, self.block_pools, rows):
            self._free_out_of_window(spec, pool, row, num_computed_tokens)
        needed = [spec.blocks_needed(total) - len(row) - len(hit) for spec, row, hit in zip(self.specs, rows, hits)]
        # A hit on a free (cached) block takes it out of the free queue too.
        taken = [n + sum(b.ref_cnt == 0 for b in hit) for n, hit in zip(needed, hits)]
        if any(t > pool.num_free_blocks for t, pool in zip(taken, self.block_pools)):
            return False
        for n, pool, row, hit in zip(needed, self.block_pools, rows, hits):
            pool.touch(hit)
            row.extend(hit)
            if n > 0:
                row.extend(pool.get_new_blocks(n))
        return True

    def _cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash and cache the blocks that the first `num_tokens` tokens fill completely."""
        num_full = num_tokens // self.specs[0].block_size
        done = self.num_cached_blocks.get(request_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(request_id, token_ids, num_tokens)
        for pool, row in zip(self.block_pools, self.req_to_blocks[request_id]):
            cached = pool.cache_full_blocks(row[done:num_full], hashes[done:num_full])
            for block in cached:
                assert block.block_hash is not None  # cache_full_blocks hashed it
                self._pending.append((pool, block, block.block_hash))
        self._pending_num_cached.setdefault(request_id, done)
        self.num_cached_blocks[request_id] = num_full

    def commit(self) -> None:
        """The step has run: the blocks hashed when it was planned hold their K/V now."""
        self._pending.clear()
        self._pending_num_cached.clear()

    def rollback(self) -> None:
        """The step did not run (it raised or was interrupted): forget the hashes its plan gave
        blocks, whose K/V may be unwritten, so that the step can be planned again."""
        for pool, block, block_hash in self._pending:
            if block.block_hash == block_hash:
                pool.uncache_block(block)
        for request_id, done in self._pending_num_cached.items():
            if request_id in self.num_cached_blocks:
                self.num_cached_blocks[request_id] = done
        self.commit()

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[BlockHash]:
        """The request's full-block hashes over its first `num_tokens` tokens (extended, never recomputed)."""
        known = self.req_to_block_hashes.get(request_id, [])
        if len(known) < num_tokens // self.specs[0].block_size:
            known = hash_request_blocks(token_ids[:num_tokens], self.specs[0].block_size, known)
            self.req_to_block_hashes[request_id] = known
        return known

    def trim(self, request_id: str, num_tokens: int) -> list[list[int]]:
        """Give back the trailing blocks no longer needed for the request's first `num_tokens` tokens
        (speculative decoding: blocks taken for drafts that were all rejected); returns their ids per
        group. They hold no known token, so none of them is cached."""
        freed: list[list[int]] = []
        for spec, pool, row in zip(self.specs, self.block_pools, self.req_to_blocks.get(request_id, [])):
            keep = spec.blocks_needed(num_tokens)
            extra = row[keep:]
            del row[keep:]
            pool.free_blocks(reversed(extra))
            freed.append([b.block_id for b in extra])
        return freed

    def free(self, request_id: str) -> None:
        """Give back every block of a finished or preempted request, last block first: its cached
        blocks then wait in the free queue with the deepest first in line for eviction, so a
        shared prefix's first blocks, which more requests can hit, stay longest."""
        for pool, row in zip(self.block_pools, self.req_to_blocks.pop(request_id, [])):
            pool.free_blocks(list(reversed(row)))
        self.req_to_block_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

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
