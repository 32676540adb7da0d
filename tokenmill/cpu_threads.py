"""CPU threading: OpenMP defaults, and how many threads each step gets.

torch's CPU kernels run each op as an OpenMP parallel region that ends at a
barrier. On an idle machine that is cheap, but when other processes share the
cores a region waits for a descheduled thread a whole scheduler time slice:
decode-sized ops (a few hundred per step, 0.05-2 ms each) then take ~5 ms
each, and a step gets up to 10x slower than on one thread.

Two defences:
- `set_openmp_defaults`: idle OpenMP threads sleep instead of spinning, so
  they do not steal the cores from the thread doing the work (a default only:
  a value the user set wins; it must run before torch loads libgomp, so child
  processes call it first thing, in `init_child_process`).
- `StepThreads`: steps use every core only while a periodic probe (the best
  of a few decode-sized matmuls on 1 thread, then on all) shows that the
  parallel run really is faster right now, else one thread.
"""

from __future__ import annotations

import os
import time


def set_openmp_defaults() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class StepThreads:
    """Chooses torch's intra-op thread count before each step.

    Every core while a periodic probe (a decode-sized matmul pair, timed on one
    thread and on all) shows that running in parallel pays right now; one
    thread while other processes keep the cores busy enough that it does not.
    """

    PROBE_INTERVAL_S = 2.0
    SPEEDUP_NEEDED = 0.8  # the parallel probe must take at most this fraction of the serial one
    PROBE_CALLS = 3  # timed calls per thread count; the fastest counts

    def __init__(self, dtype, hidden_size: int, intermediate_size: int, max_threads: int | None = None) -> None:
        """The probe is one decode-sized MLP matmul of the model being run: [64, hidden] x [hidden, inter]."""
        import torch
        self._torch = torch
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = self.max_threads
        self._current = torch.get_num_threads()
        self._next_probe = 0.0
        self._x = torch.randn(64, hidden_size).to(dtype)
        self._w = torch.randn(intermediate_size, hidden_size).to(dtype)

    def apply(self) -> int:
        if self.max_threads > 1 and time.monotonic() >= self._next_probe:
            self.threads = self._probe()
            self._next_probe = time.monotonic() + self.PROBE_INTERVAL_S
        self._set(self.threads)
        return self.threads

    def _set(self, threads: int) -> None:
        if threads != self._current:
            self._torch.set_num_threads(threads)
            self._current = threads

    def _probe(self) -> int:
        # Costs ~1.5 ms on an idle machine, ~30 ms on a contended one (the parallel calls wait).
        # The best of a few calls per count: one call that happens to overlap a short burst of
        # another process (the engine core or the frontend handling the last step's output) would
        # otherwise pin the steps of the next interval to one thread on an idle machine.
        linear = self._torch.nn.functional.linear
        timings: dict[int, float] = {}
        for threads in (1, self.max_threads):
            self._set(threads)
            linear(self._x, self._w)  # wakes the team up
            best = float("inf")
            for _ in range(self.PROBE_CALLS):
                start = time.perf_counter()
                linear(self._x, self._w)
                best = min(best, time.perf_counter() - start)
            timings[threads] = best
        if timings[self.max_threads] <= self.SPEEDUP_NEEDED * timings[1]:
            return self.max_threads
        return 1
