"""Per-request block tables on top of the block pool, and prefix-cache lookups."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_pool import BlockPool, hash_block
from tokenmill.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.blocks: dict[int, list[int]] = {}  # handle -> block ids, in token order
        self.num_cached_blocks: dict[int, int] = {}  # handle -> leading blocks already in the cache
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix; at least one token is always left to compute."""
        if not self.enable_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve room for `num_new_tokens` more tokens; return the new block ids, or None if the pool is short.

        With `cached_blocks` (a first schedule), those become the request's leading blocks.
        """
        handle = request.handle
        held = self.blocks.get(handle, [])
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(cached_blocks)
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
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return list(cached_blocks) + new_blocks

    def free(self, request: Request) -> None:
        blocks = self.blocks.pop(request.handle, [])
        self.num_cached_blocks.pop(request.handle, None)
        self.pool.release(reversed(blocks))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written.

        Safe within the same step: backends write a step's K/V before any attention reads it.
        """
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.handle, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        blocks = self.blocks[request.handle]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.handle] = num_full

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
