"""The block pool: which physical KV cache blocks are free, and who holds the rest.

    block id:   0      1   2   3   4   5   6   7
               null   [A] [A] [ ] [B] [ ] [A] [ ]      free queue: 3 -> 5 -> 7
               (never handed out; stands in for "no block here")

A block is handed out with ref count 1 and goes back to the tail of the free queue when
its count drops to 0. Handing out from the head and returning to the tail means a freed
block is reused last: helpful when reading a trace, and how vLLM's pool behaves too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """One physical block: its id and how many block tables point at it."""

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Free-block queue plus ref counts over `num_blocks` blocks, block 0 reserved as null."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs at least 2 blocks (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever: never in the free queue
        self.free_queue: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever get (the null block excluded)."""
        return self.num_blocks - 1

    def get_usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue (ref count 1 each)."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool ({self.num_free_blocks} free).")
        blocks = []
        for _ in range(n):
            block = self.blocks[self.free_queue.popleft()]
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add a reference to blocks that another request will share."""
        for block in blocks:
            assert block.ref_cnt > 0, f"cannot share free block {block.block_id}"
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes back to the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block.block_id)
