"""The pool of KV blocks: reference counts, and a prefix cache of full blocks.

A full block is known by the hash of (its parent's hash, its tokens). Blocks
whose reference count drops to zero go to the tail of an LRU free queue but
keep their hash, so a later request with the same prefix can take them back;
fresh allocations take from the head, evicting the oldest cached block.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable


def hash_block(parent_hash: int | None, tokens: bytes) -> int:
    """`tokens`: the block's token ids, packed int32."""
    return hash((parent_hash, tokens))


class HashChain(list):
    """A request's block hashes, one per full block. `seed` stands in for the first block's
    parent: requests whose KV differs for the same tokens (another LoRA adapter, LongRoPE's
    factors: `ModelArch.prefix_cache_seed`) get other hashes, so the prefix cache never shares
    blocks between them."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed


def parent_hash(chain: list[int]) -> int | None:
    """The parent of the next block's hash: the last one, or the chain's seed."""
    return chain[-1] if chain else getattr(chain, "seed", None)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_queue), "caller checks num_free first"
        blocks = []
        pop, ref_counts, block_hash = self.free_queue.popitem, self.ref_counts, self.block_hash
        for _ in range(n):
            block, _ = pop(last=False)
            if block_hash[block] is not None:
                self._evict(block)
            ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def hashes_evicted_by(self, n: int) -> set[int]:
        """The prefix-cache entries that allocating `n` blocks now would evict (changes nothing)."""
        if not self.enable_caching:
            return set()
        hashes = (self.block_hash[block] for block in itertools.islice(self.free_queue, n))
        return {h for h in hashes if h is not None}

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on prefix-cache hits (reviving free-but-cached ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; pass a request's blocks tail first, so its last blocks are evicted first."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def cache(self, block: int, block_hash: int) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:  # the same content already lives in another block
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def cache_many(self, blocks: list[int], hashes: list[int]) -> None:
        """`cache` for each (block, hash), in order."""
        if not self.enable_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        for block, h in zip(blocks, hashes):
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block

    def _evict(self, block: int) -> None:
        old = self.block_hash[block]
        if old is not None:
            self.block_hash[block] = None
            if self.cached.get(old) == block:
                del self.cached[old]
            self.num_evictions += 1

