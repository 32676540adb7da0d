"""Per-request block tables on top of the block pool, and prefix-cache lookups.

Requests are named by handle; their token ids come in as int32 arrays and their hash chain
(`block_hashes`, one hash per full block, grown lazily) is owned by the caller.

Sliding windows (`window` W: set when every layer of the model, and of a draft model sharing
the tables, slides): a query at position p reads only keys p-W+1..p, so once a request's next
query is at p, its blocks wholly before p-W+1 are never read again. `release_out_of_window`
gives them back to the pool while the request runs (the planner calls it whenever a row grows),
so a decoding request holds at most ceil(W / block_size) + 2 blocks. Released entries keep their
place (and stale id) in the block table, on the workers too: positions stay valid, no message
changes, and no attention backend reads a block wholly before its window
(`layers/attention/backend.py`), so a stale id that now belongs to another request is never
dereferenced. Only the unreleased tail is freed at the end.

Prefix caching with windows: the simplest correct rule. A hit is the longest chain of cached
full blocks from the start, as without windows (every block's K/V is exact for its tokens,
whatever window the layers use); the hits wholly before the window of the first position
still to compute are released again at once, so only the hits inside the window stay held.
A full block released by the window keeps its hash in the pool's LRU free queue, so later
requests sharing the prefix still find it until it is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.core.block_pool import BlockPool, hash_block, parent_hash


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, window: int | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.window = window  # every layer slides with at most this window: release what falls out
        self.blocks: dict[int, list[int]] = {}  # handle -> block ids, in token order
        self.num_cached_blocks: dict[int, int] = {}  # handle -> leading blocks already in the cache
        self.num_released: dict[int, int] = {}  # handle -> leading blocks given back (window)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, tokens: np.ndarray, block_hashes: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix; at least one token is always left to compute."""
        if not self.enable_caching:
            return []
        self._update_hashes(tokens, block_hashes, len(tokens))
        max_blocks = (len(tokens) - 1) // self.block_size
        hits = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate(self, handle: int, num_computed: int, num_new_tokens: int,
                 cached_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve room for `num_new_tokens` after `num_computed`; return the new block ids, or
        None (and change nothing) if the pool is short.

        With `cached_blocks` (a first schedule: prefix-cache hits, counted in `num_computed`),
        those become the request's leading blocks and lead the returned list. Full blocks are
        registered in the prefix cache separately, by `cache_full_blocks`.
        """
        held = self.blocks.get(handle)
        num_held = len(held) if held is not None else 0
        if not cached_blocks:
            need = self.blocks_needed(num_computed + num_new_tokens) - num_held
            if need > self.pool.num_free:
                return None
            new_blocks = self.pool.allocate(need) if need > 0 else []
            if held is None:
                self.blocks[handle] = new_blocks[:]
                self.num_cached_blocks.setdefault(handle, 0)
            else:
                held.extend(new_blocks)
            return new_blocks
        need = self.blocks_needed(num_computed + num_new_tokens) - num_held - len(cached_blocks)
        # Cached blocks sitting in the free queue are revived, so they count against the free space.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if need + revived > self.pool.num_free:
            return None
        self.pool.touch(cached_blocks)
        new_blocks = self.pool.allocate(max(need, 0))
        held = self.blocks.setdefault(handle, [])
        held.extend(cached_blocks)
        held.extend(new_blocks)
        self.num_cached_blocks[handle] = max(self.num_cached_blocks.get(handle, 0), len(cached_blocks))
        self.release_out_of_window(handle, num_computed)
        return list(cached_blocks) + new_blocks

    def num_held(self, handle: int) -> int:
        """Blocks the request holds now (its table, less the ones released by the window)."""
        return len(self.blocks.get(handle, ())) - self.num_released.get(handle, 0)

    def release_out_of_window(self, handle: int, next_position: int) -> None:
        """Give back the request's blocks wholly before the window of `next_position` (a lower
        bound on every position it will still compute). No-op without a window."""
        if self.window is None:
            return
        dead = max(next_position - self.window + 1, 0) // self.block_size
        done = self.num_released.get(handle, 0)
        if dead > done:
            blocks = self.blocks[handle]
            dead = min(dead, len(blocks))
            self.pool.release(reversed(blocks[done:dead]))
            self.num_released[handle] = dead

    def append_blocks(self, handles: list[int], counts: list[int], blocks: list[int]) -> None:
        """Add blocks already taken from the pool (by `pool.allocate`) to running requests' tables:
        the first counts[0] to handles[0]'s, and so on."""
        tables, start = self.blocks, 0
        for handle, count in zip(handles, counts):
            tables[handle].extend(blocks[start:start + count])
            start += count

    def hashes_to_cache(self, handle: int, num_tokens: int, tokens: np.ndarray, block_hashes: list[int]) -> list[int]:
        """The hashes `cache_full_blocks` would register now (it may still skip some already cached)."""
        if not self.enable_caching:
            return []
        num_full = num_tokens // self.block_size
        self._update_hashes(tokens, block_hashes, num_full * self.block_size)
        return block_hashes[self.num_cached_blocks.get(handle, 0):num_full]

    def free(self, handle: int) -> None:
        blocks = self.blocks.pop(handle, [])
        self.num_cached_blocks.pop(handle, None)
        self.pool.release(reversed(blocks[self.num_released.pop(handle, 0):]))

    def cache_full_blocks(self, handle: int, num_tokens: int, tokens: np.ndarray, block_hashes: list[int]) -> int:
        """Register the blocks that are full within the first `num_tokens` of `tokens` (whose
        K/V this step writes: backends write a step's K/V before any attention reads it).
        Returns how many leading blocks of the request are now in the cache."""
        start = self.num_cached_blocks.get(handle, 0)
        if not self.enable_caching:
            return start
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return start
        self._update_hashes(tokens, block_hashes, num_full * self.block_size)
        blocks = self.blocks[handle]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], block_hashes[i])
        self.num_cached_blocks[handle] = num_full
        return num_full

    def cache_next_blocks(self, handles: list[int], block_tokens: np.ndarray, hash_chains: list[list[int]]) -> None:
        """`cache_full_blocks` for requests that each fill exactly their next block, in order:
        `block_tokens[i]` holds the tokens of request i's block (int32, one row per request)."""
        data, width = block_tokens.tobytes(), block_tokens.shape[1] * block_tokens.itemsize
        tables, num_cached = self.blocks, self.num_cached_blocks
        blocks, hashes = [], []
        for i, (handle, chain) in enumerate(zip(handles, hash_chains)):
            index = num_cached[handle]
            if len(chain) == index:
                chain.append(hash_block(parent_hash(chain), data[i * width:(i + 1) * width]))
            blocks.append(tables[handle][index])
            hashes.append(chain[index])
            num_cached[handle] = index + 1
        self.pool.cache_many(blocks, hashes)

    def _update_hashes(self, tokens: np.ndarray, hashes: list[int], num_tokens: int) -> None:
        """Extend the hash chain over the full blocks of `tokens[:num_tokens]`."""
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            hashes.append(hash_block(parent_hash(hashes), tokens[i * bs:(i + 1) * bs].tobytes()))
