"""One process's telemetry: message counters per channel, step-phase timings, optional trace.

Channels (each counted by both ends, kind byte included):
  requests        front-end -> core   (add, abort)
  outputs         core -> front-end   (token ids)
  steps           core -> workers     (SchedulerOutput, through the shm ring)
  results         worker -> core      (ModelRunnerOutput, driver rank)
  utility_calls / utility_results, worker_calls / worker_call_results: control messages

Invariant: every counter has exactly one writing thread. A channel's counters are written
by the one thread that sends or receives its messages (in the engine core: the input thread
for requests and utility_calls, the output thread for outputs and utility_results, the busy
loop for steps and worker_calls, the worker-reply reader for results and
worker_call_results); a step phase's by the one thread that records it (see
`StepTimings`). `reset()` writes none of them: it is a request (a reset counter that only
resetting threads write), which each writer acts on before it next counts; until then,
snapshots read the counter as reset. So a reset from a utility handler or an API thread
never races an I/O thread's update (no lost reset, no half-reset counter). Snapshots may be
taken from any thread; they rely on the GIL making each single read (and each copy of a
deque) atomic, and their counters may be a message apart from each other.
"""

from __future__ import annotations

import os
import time

from tokenmill.metrics.gc_pauses import trace_pauses
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.metrics.step_timings import StepTimings
from tokenmill.metrics.step_trace import StepTrace
from tokenmill.protocol import ProcessTelemetry


class Telemetry:
    def __init__(self, role: str, trace_path: str | None = None, label: str | None = None) -> None:
        """`label`: the trace track's name (default: the role)."""
        self.role = role
        self.channels: dict[str, MessageStats] = {}
        self.timings = StepTimings()
        self.trace = StepTrace(trace_path, role, label) if trace_path else None
        # The garbage collector's pauses on the trace (they stall the step loop; gc_pauses.py).
        self._stop_gc_trace = trace_pauses(self.trace.add) if self.trace is not None else None
        self._since = time.perf_counter()

    def channel(self, name: str) -> MessageStats:
        """Channel `name`'s counters (created on first use, by its writer or before it starts)."""
        stats = self.channels.get(name)
        if stats is None:
            stats = self.channels[name] = MessageStats()
        return stats

    def record(self, name: str, start_s: float, end_s: float, args: dict | None = None) -> None:
        """One phase of a step: its duration, and a trace event when tracing."""
        self.timings.add(name, end_s - start_s)
        if self.trace is not None:
            self.trace.add(name, start_s, end_s, args)

    def reset(self) -> None:
        """Ask every counter's writer to start afresh (writes no counter; safe from any thread)."""
        for stats in list(self.channels.values()):
            stats.request_reset()
        self.timings.request_reset()
        self._since = time.perf_counter()

    def snapshot(self) -> ProcessTelemetry:
        return ProcessTelemetry(role=self.role, pid=os.getpid(), elapsed_s=time.perf_counter() - self._since,
                                channels={k: v.snapshot() for k, v in list(self.channels.items())},
                                timings=self.timings.summary())

    def close(self) -> None:
        """Write this process's trace part, if tracing."""
        if self._stop_gc_trace is not None:
            self._stop_gc_trace()
            self._stop_gc_trace = None
        if self.trace is not None:
            self.trace.write_part()
