"""The block pool: which physical KV cache blocks are free, who holds the rest, and which free
blocks still hold a cached prefix.

    block id:   0      1   2   3   4   5   6   7
               null   [A] [A] [ ] [B] [#] [A] [#]      free queue (eviction order): 3 -> 7 -> 5
               (never handed out; stands in for "no block here")      # = free, still cached

A block is handed out with ref count 1; a request that finds it by its hash (prefix caching)
adds a reference, so one block can sit in several block tables. When the count drops to 0 the
block goes to the tail of the free queue but keeps its hash: until it is handed out again, a
later request with the same prefix can take it back out of the queue (`touch`). Allocation
takes the head of the queue, the block freed longest ago, and drops its hash then (eviction).

The free queue must take a block out of its middle (a cache hit) as cheaply as off its head:
vLLM links the blocks into a doubly linked list for that; an `OrderedDict` is the same linked
list, with the block id as its key.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
"""SHA-256 of (parent block's hash, this block's token ids, extra keys)."""


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    """The hash of one full block: it covers every token before it, through the parent's hash.

        block 0: h0 = H(None, tokens[0:16])      block 1: h1 = H(h0, tokens[16:32])   ...

    Equal hashes mean equal prefixes, so the block's K/V can be reused. SHA-256, not Python's
    `hash()`: its value is the same in every process and a collision is not a practical concern.
    `extra_keys` is for anything else the K/V depend on (none here; vLLM puts LoRA ids and
    multimodal inputs there).
    """
    return hashlib.sha256(pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)).digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, start: list[BlockHash] | None = None
) -> list[BlockHash]:
    """The hashes of every FULL block of `token_ids`, extending `start` (the hashes known already)."""
    hashes = list(start or [])
    for b in range(len(hashes), len(token_ids) // block_size):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, token_ids[b * block_size : (b + 1) * block_size])
        )
    return hashes


@dataclass
class KVCacheBlock:
    """One physical block: its id, how many block tables point at it, and its hash while it is
    a full block of some prefix (None: not cached)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Free-block queue in eviction order, ref counts, and the hash -> block map of cached blocks,
    over `num_blocks` blocks, block 0 reserved as null."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs at least 2 blocks (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever: never in the free queue
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted when needed)."""
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever get (the null block excluded)."""
        return self.num_blocks - 1

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue (ref count 1 each), evicting their cached prefixes."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool ({self.num_free_blocks} free).")
        blocks = []
        for _ in range(n):
            block = self.blocks[self.free_queue.popitem(last=False)[0]]
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            self.uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a cache hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> list[KVCacheBlock]:
        """Give each full block its hash and make it findable; a block whose prefix is cached
        in another block already (two requests computed it side by side) stays uncached.
        Returns the blocks that got a hash."""
        cached = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block is self.null_block:
                continue
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                cached.append(block)
        return cached

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the tail of the free
        queue, in the order given (the first given is evicted first). Its hash stays."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget the block's cached prefix (it is about to be overwritten)."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
