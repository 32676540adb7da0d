"""Engine statistics logged every few seconds during long runs (in the engine core)."""

from __future__ import annotations

import logging
import time

from tokenmill.protocol import SchedulerStats

logger = logging.getLogger("tokenmill.stats")


class StatsLogger:
    def __init__(self, interval_s: float = 5.0, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self.enabled = enabled
        self._last = time.monotonic()
        self._scheduled_tokens = 0
        self._generated_tokens = 0
        self._last_hits = self._last_queries = 0

    def record_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        self._scheduled_tokens += scheduled_tokens
        self._generated_tokens += generated_tokens

    def maybe_log(self, stats: SchedulerStats) -> str | None:
        """Log one line if the interval has passed; return it (for tests)."""
        now = time.monotonic()
        elapsed = now - self._last
        if not self.enabled or elapsed < self.interval_s:
            return None
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        line = (f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_cache_usage:.1%}, "
                f"prefix cache hit rate: {hits / queries if queries else 0.0:.1%}, "
                f"preemptions: {stats.num_preemptions}, "
                f"scheduled: {self._scheduled_tokens / elapsed:.1f} tok/s, "
                f"generated: {self._generated_tokens / elapsed:.1f} tok/s")
        logger.info(line)
        self._last, self._scheduled_tokens, self._generated_tokens = now, 0, 0
        self._last_hits, self._last_queries = stats.prefix_cache_hits, stats.prefix_cache_queries
        return line
