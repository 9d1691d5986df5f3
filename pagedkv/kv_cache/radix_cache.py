"""SGLang's prefix cache: a radix tree over token ids, beside vLLM's chain of block hashes
(block_pool.py).

    root ─ "You are a tutor. " ─┬─ "What is a " ─┬─ "list?"      leaf
                                │                └─ "dict?"      leaf
                                └─ "Explain for."                leaf

Each edge holds a run of tokens of any length: the tree knows prefixes token by token, not
block by block, so a prompt that shares 33 tokens with a cached one reuses 33, where the chain
reuses the 32 of its full blocks. A lookup walks down from the root and may stop inside an edge;
the edge is split there, so that the prefix found ends on a node. Inserting a sequence that
leaves an edge half way splits it the same way, and the rest hangs below as a new leaf.

A running request locks the path from its node to the root (each node's `lock_ref` + 1), so no
token it reads can be evicted. Eviction takes the unlocked leaf used least recently, whole, and
repeats until enough tokens are free; a node whose last child went becomes a leaf itself. The
chain evicts blocks instead, in the order they were freed, last block of a request first.

The pool holds `capacity` tokens: those in the tree plus those a running request computed and
has not handed to the tree yet (it does when it finishes, as SGLang's `cache_finished_req`).
Here tokens are counted, not stored: which slots of a K/V pool a node's tokens occupy (SGLang's
`value`) plays no part in what is hit or evicted. Recency is a counter that each lookup and
insert advances, not a clock, so that runs and tests are reproducible.

SGLang: python/sglang/srt/mem_cache/radix_cache.py (`RadixCache.match_prefix`, `insert`,
`_split_node`, `inc_lock_ref`, `dec_lock_ref`, `evict`, `cache_finished_req`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree and the node below it: the edge's tokens, its children by their first
    token, how many running requests lock it, and when a lookup or insert last went through it."""

    key: tuple[int, ...]
    parent: RadixNode | None = field(repr=False)
    children: dict[int, RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0

    def token_ids(self) -> tuple[int, ...]:
        """The whole prefix this node ends: every edge's tokens from the root down to here."""
        keys = []
        node: RadixNode | None = self
        while node is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(t for key in reversed(keys) for t in key)


@dataclass(frozen=True)
class EvictedTokens:
    """Tokens that left a prefix cache: `token_ids[start:]`, the end of the prefix `token_ids`.
    A radix leaf's whole edge, or one block of the chain (then `start` is a block boundary)."""

    token_ids: tuple[int, ...]
    start: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) - self.start


@dataclass
class RadixRequest:
    """A request admitted by `RadixCache.start`: the node its hit ends on (locked until it
    finishes), the tokens found, and the tokens it computes itself (reserved in the pool)."""

    node: RadixNode
    num_hit: int
    num_reserved: int


class RadixCache:
    """A radix tree of cached prefixes over a pool of `capacity` tokens, with locks for running
    requests and eviction of the least recently used unlocked leaf."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RadixCache needs room for at least one token, got capacity {capacity}.")
        self.capacity = capacity
        # Locked forever, as SGLang's root: it is never a leaf to evict.
        self.root = RadixNode(key=(), parent=None, lock_ref=1)
        self.num_cached_tokens = 0
        """Tokens in the tree (locked or not)."""
        self.num_reserved_tokens = 0
        """Tokens that running requests computed and hold outside the tree."""
        self._clock = 0

    @property
    def num_free_tokens(self) -> int:
        return self.capacity - self.num_cached_tokens - self.num_reserved_tokens

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before their children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[int, RadixNode]:
        """The longest cached prefix of `token_ids`: its length and the node it ends on (an edge
        it ends inside is split there). Every node on the way counts as used now."""
        return self._walk(token_ids)

    def insert(self, token_ids: Sequence[int]) -> int:
        """Cache `token_ids`: the part not in the tree yet becomes a new leaf. Returns how many
        leading tokens were cached already. Takes no room of its own: the caller computed the
        new tokens, and their room is the caller's (see `finish`)."""
        num_present, node = self._walk(token_ids)
        if num_present < len(token_ids):
            leaf = RadixNode(tuple(token_ids[num_present:]), parent=node, last_access=self._clock)
            node.children[leaf.key[0]] = leaf
            self.num_cached_tokens += len(leaf.key)
        return num_present

    def lock(self, node: RadixNode) -> None:
        """A request reads the prefix `node` ends: nothing on its path may be evicted."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # only the root has no parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"radix node {node.token_ids()[-8:]}... unlocked more often than locked")
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> list[EvictedTokens]:
        """Drop unlocked leaves, least recently used first, until at least `num_tokens` tokens
        left the tree or none is left to drop; returns them in the order they went. A leaf goes
        whole (it may free more than asked), and a parent left without children joins the
        candidates."""
        order = itertools.count()  # ties of last_access: the leaf found first goes first
        heap = [(n.last_access, next(order), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted: list[EvictedTokens] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            prefix = leaf.token_ids()
            evicted.append(EvictedTokens(prefix, len(prefix) - len(leaf.key)))
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.num_cached_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return evicted

    def start(self, token_ids: Sequence[int], num_tokens: int) -> tuple[RadixRequest, list[EvictedTokens]] | None:
        """Admit a request with prompt `token_ids` that will hold the K/V of `num_tokens` tokens
        (its prompt and the outputs it computes): look up its prefix, never its last token (its
        logits are needed, as in the chain), lock what was found, and reserve room for the rest,
        evicting what must go. Returns the request and the evictions, or None (nothing changed
        but the evictions) when the rest does not fit even in an emptied cache."""
        num_hit, node = self.match_prefix(token_ids[: len(token_ids) - 1])
        self.lock(node)
        need = num_tokens - num_hit
        evicted = self.evict(need - self.num_free_tokens) if need > self.num_free_tokens else []
        if need > self.num_free_tokens:
            self.unlock(node)
            return None
        self.num_reserved_tokens += need
        return RadixRequest(node, num_hit, need), evicted

    def finish(self, request: RadixRequest, token_ids: Sequence[int]) -> None:
        """The request is done: cache the tokens whose K/V it holds (`token_ids`, from the first),
        hand its reserved room to the tree (a part cached meanwhile by another request is freed),
        and unlock its prefix."""
        self.insert(token_ids)
        self.num_reserved_tokens -= request.num_reserved
        self.unlock(request.node)

    def _walk(self, token_ids: Sequence[int]) -> tuple[int, RadixNode]:
        """Follow `token_ids` down from the root as far as the tree has them, splitting the edge
        they leave inside; marks every node passed as used now."""
        self._clock += 1
        node, i = self.root, 0
        while i < len(token_ids) and (child := node.children.get(token_ids[i])) is not None:
            n = 1  # the first token matched already: it is the child's key in the dict
            while n < len(child.key) and i + n < len(token_ids) and child.key[n] == token_ids[i + n]:
                n += 1
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            node, i = child, i + n
        return i, node

    @staticmethod
    def _split(child: RadixNode, n: int) -> RadixNode:
        """Cut `child`'s edge after its first `n` tokens: a new node takes them (and the locks and
        recency of the whole edge), with `child` keeping the rest below it. Returns the new node."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(child.key[:n], parent=parent, lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper
