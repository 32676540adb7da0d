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
- `StepThreads`: steps use every core unless other processes kept more than
  half a core busy over the last probe interval (all CPUs' busy and stolen
  time in /proc/stat less the engine's own: this process and its ancestors,
  i.e. the engine core and the frontend, whose host work between steps would
  otherwise send an idle machine's steps to one thread), then one thread. Where /proc
  cannot be read: a timing probe (the best of a few decode-sized matmuls on 1
  thread, then on all; parallel where it is really faster right now).
  The load reading replaced the timing probe as the default because on
  virtual machines (an AMX Xeon under KVM) one thread's time for the same
  matmul swung 2x from call to call, and the probe kept idle machines on one
  thread: 154 against 175 output tok/s with every step on two threads.
"""

from __future__ import annotations

import os
import time


def set_openmp_defaults() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


STEP_THREADS_ENV = "TOKENMILL_CPU_STEP_THREADS"


def fixed_threads() -> int:
    """TOKENMILL_CPU_STEP_THREADS=N: every step on N threads, no probe (0 or unset: probe)."""
    raw = os.environ.get(STEP_THREADS_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"{STEP_THREADS_ENV}={raw!r}: expected a whole number of threads (0: probe)")
    return int(raw)


class StepThreads:
    """Chooses torch's intra-op thread count before each step.

    Every core while a periodic probe (a decode-sized matmul pair, timed on one
    thread and on all) shows that running in parallel pays right now; one
    thread while other processes keep the cores busy enough that it does not.
    """

    PROBE_INTERVAL_S = 2.0
    OTHERS_ALLOWED = 0.5  # cores other processes may keep busy (on average) before steps go serial
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
        self._last_load: tuple[float, int, int] | None = _cpu_load()
        self.fixed = fixed_threads()  # TOKENMILL_CPU_STEP_THREADS: that many, never probed
        self.chosen: dict[int, int] = {}  # thread count -> steps run with it (benchmarks read it)

    def apply(self) -> int:
        if self.fixed:
            self.threads = self.fixed
        elif self.max_threads > 1 and time.monotonic() >= self._next_probe:
            self.threads = self._probe()
            self._next_probe = time.monotonic() + self.PROBE_INTERVAL_S
        self._set(self.threads)
        self.chosen[self.threads] = self.chosen.get(self.threads, 0) + 1
        return self.threads

    def _set(self, threads: int) -> None:
        if threads != self._current:
            self._torch.set_num_threads(threads)
            self._current = threads

    def _probe(self) -> int:
        load = _cpu_load()
        if load is not None and self._last_load is not None:
            (t0, busy0, own0), (t1, busy1, own1) = self._last_load, load
            self._last_load = load
            others = ((busy1 - busy0) - (own1 - own0)) / _TICKS_PER_S / max(t1 - t0, 1e-3)
            return self.max_threads if others <= self.OTHERS_ALLOWED else 1
        return self._timing_probe()

    def _timing_probe(self) -> int:
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


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_load() -> tuple[float, int, int] | None:
    """(monotonic time, busy + stolen ticks of all CPUs, the engine's own ticks), or None off Linux.

    The engine's own: this process and its ancestors (the engine core, the frontend and
    whatever idle process started them), not their other children, so that another engine
    or test worker beside this one still counts as load."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
        own = _ancestry_ticks()
    except (OSError, IndexError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return time.monotonic(), user + nice + system + irq + softirq + steal, own


def _process_ticks(pid: str) -> tuple[int, int]:
    """(user + system ticks, parent pid) of one process from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        after_name = f.read().rsplit(")", 1)[1].split()  # after the command name: state is field 0
    return int(after_name[11]) + int(after_name[12]), int(after_name[1])


def _ancestry_ticks(max_depth: int = 8) -> int:
    """CPU ticks of this process and of its ancestors below init."""
    ticks, parent = _process_ticks("self")
    for _ in range(max_depth):
        if parent <= 1:
            break
        try:
            more, parent = _process_ticks(str(parent))
        except (OSError, IndexError, ValueError):  # the parent exited between two reads
            break
        ticks += more
    return ticks
