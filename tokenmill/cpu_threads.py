"""CPU threading: OpenMP defaults, and how many threads each step gets.

torch's CPU kernels run each op as an OpenMP parallel region that ends at a
barrier. On an idle machine that is cheap, but when other processes share the
cores a region waits for a descheduled thread a whole scheduler time slice:
decode-sized ops (a few hundred per step, 0.05-2 ms each) then take ~5 ms
each, and a step gets 10x slower than on one thread. Big ops (prefill
matmuls) hardly notice.

Two defences:
- `set_openmp_defaults`: idle OpenMP threads sleep instead of spinning, so
  they do not steal the cores from the thread doing the work (a default only:
  a value the user set wins; it must run before torch loads libgomp, which is
  why `tokenmill/__init__.py` calls it first).
- `StepThreads`: big steps use every core; small steps use every core only
  while a periodic probe (two decode-sized matmuls on 1 thread, then on all)
  shows that the parallel run really is faster right now.
"""

from __future__ import annotations

import os
import time


def set_openmp_defaults() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class StepThreads:
    """Chooses torch's intra-op thread count per step from the step's token count."""

    SMALL_STEP_TOKENS = 512  # at most this many tokens: decode-sized ops
    PROBE_INTERVAL_S = 2.0
    SPEEDUP_NEEDED = 0.75  # parallel probe must take at most this fraction of the serial one

    def __init__(self, dtype, max_threads: int | None = None) -> None:
        import torch
        self._torch = torch
        self.max_threads = max_threads or torch.get_num_threads()
        self.small_threads = self.max_threads
        self._current = torch.get_num_threads()
        self._next_probe = 0.0
        self._x = torch.randn(64, 576).to(dtype)
        self._w = torch.randn(1536, 576).to(dtype)

    def apply(self, num_tokens: int) -> int:
        threads = self.max_threads
        if self.max_threads > 1 and num_tokens <= self.SMALL_STEP_TOKENS:
            now = time.monotonic()
            if now >= self._next_probe:
                self.small_threads = self._probe()
                self._next_probe = time.monotonic() + self.PROBE_INTERVAL_S
            threads = self.small_threads
        self._set(threads)
        return threads

    def _set(self, threads: int) -> None:
        if threads != self._current:
            self._torch.set_num_threads(threads)
            self._current = threads

    def _probe(self) -> int:
        linear = self._torch.nn.functional.linear
        timings = {}
        for threads in (1, self.max_threads, 1, self.max_threads):
            self._set(threads)
            linear(self._x, self._w)  # warm the team up
            start = time.perf_counter()
            linear(self._x, self._w)
            linear(self._x, self._w)
            elapsed = time.perf_counter() - start
            timings[threads] = min(elapsed, timings.get(threads, elapsed))
        if timings[self.max_threads] <= self.SPEEDUP_NEEDED * timings[1]:
            return self.max_threads
        return 1
