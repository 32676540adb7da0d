"""Per-phase step durations: count and mean since the last reset, p50 / p99 over recent samples."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from tokenmill.protocol import TimingStats

_RECENT = 4096


class StepTimings:
    """Thread-safe: the engine core records from its busy loop and its output thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = {}
        self._totals: dict[str, list[float]] = {}  # name -> [count, seconds]

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            recent = self._recent.get(name)
            if recent is None:
                recent = self._recent[name] = deque(maxlen=_RECENT)
                self._totals[name] = [0, 0.0]
            recent.append(seconds)
            total = self._totals[name]
            total[0] += 1
            total[1] += seconds

    def reset(self) -> None:
        with self._lock:
            self._recent.clear()
            self._totals.clear()

    def summary(self) -> dict[str, TimingStats]:
        with self._lock:
            items = [(name, np.fromiter(recent, float), *self._totals[name])
                     for name, recent in self._recent.items()]
        out = {}
        for name, recent, count, seconds in items:
            p50, p99 = np.percentile(recent, [50, 99]) * 1e6 if len(recent) else (0.0, 0.0)
            out[name] = TimingStats(count=int(count), mean_us=seconds / count * 1e6 if count else 0.0,
                                    p50_us=float(p50), p99_us=float(p99), total_us=seconds * 1e6)
        return out
