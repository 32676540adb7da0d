"""Per-phase step durations: count and mean since the last reset, p50 / p99 over recent samples.

Each phase name is recorded by one thread only (the core's busy loop records schedule,
submit, wait and update, its output thread send_outputs), so a phase's `_Series` has one
writer and needs no lock; see `tokenmill.metrics.telemetry` for the whole invariant.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tokenmill.protocol import TimingStats

_RECENT = 4096


class _Series:
    """One phase's durations; every field written by the phase's one recording thread."""

    __slots__ = ("count", "seconds", "recent", "cleared_at")

    def __init__(self, reset_at: int) -> None:
        self.recent: deque[float] = deque(maxlen=_RECENT)
        self.clear(reset_at)

    def clear(self, reset_at: int) -> None:
        self.cleared_at = reset_at
        self.count = 0
        self.seconds = 0.0
        self.recent.clear()


class StepTimings:
    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}  # a name is added by its recording thread
        self._reset_at = 0  # resets asked for (written by the resetting thread only)

    def add(self, name: str, seconds: float) -> None:
        """Record one duration of phase `name`; always from the same thread for a given name."""
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = _Series(self._reset_at)
        elif series.cleared_at != self._reset_at:
            series.clear(self._reset_at)  # the recording thread acts on a reset request
        series.count += 1
        series.seconds += seconds
        series.recent.append(seconds)

    def request_reset(self) -> None:
        """Ask every phase's recording thread to start afresh; until a phase records again, it
        is left out of `summary()`."""
        self._reset_at += 1

    def summary(self) -> dict[str, TimingStats]:
        """From any thread: one C call copies each series' recent samples (the GIL makes it atomic);
        count and total may be one sample apart from them."""
        reset_at = self._reset_at
        items = [(name, np.array(list(series.recent), dtype=float), series.count, series.seconds)
                 for name, series in list(self._series.items()) if series.cleared_at == reset_at]
        out = {}
        for name, recent, count, seconds in items:
            p50, p99 = np.percentile(recent, [50, 99]) * 1e6 if len(recent) else (0.0, 0.0)
            out[name] = TimingStats(count=int(count), mean_us=seconds / count * 1e6 if count else 0.0,
                                    p50_us=float(p50), p99_us=float(p99), total_us=seconds * 1e6)
        return out
