"""How long the device works on each step, and how long it sits idle between steps.

A step's device work runs from the start of its forward (a model pre-hook, or the runner's
`on_device_work` call before a CUDA graph replay) to the end of its sampling and read-back copy.
CUDA: events recorded at both ends; a pair is read only once its events have completed, so
measuring never synchronizes the device. CPU (and the null model): the host clock around the
forward. Durations go to `timings["device_step"]` and `timings["device_idle"]`; per pipeline
stage, they give its busy time and its bubble (`tokenmill.metrics.pipeline`).

When the step trace is on (`--trace-steps`), each step's device work also goes into it as a
`device_step` span on the host clock (args: the step, its rows and tokens), so that the stages'
device timelines line up with each other and with the host's phases (`benchmarks/pipeline_trace`).
CUDA events are placed on the host clock through one anchor event, synchronized once when the
model is attached (before any step): host time = anchor's host time + elapsed time since it.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from tokenmill.metrics.telemetry import Telemetry


class DeviceIdleMeter:
    def __init__(self, device: torch.device, telemetry: Telemetry) -> None:
        self._cuda = device.type == "cuda"
        self._telemetry = telemetry
        self._last_end: float | None = None  # host clock (CPU)
        self._start: float | None = None  # host clock (CPU): this forward's start
        self._start_event = None  # CUDA: this step's start, until its end is recorded
        self._last_end_event = None  # CUDA: the previous step's end
        self._pending: deque[tuple] = deque()  # CUDA (previous end | None, start, end, args) not yet read
        self._hooked = False
        self._args: dict | None = None  # the step being launched (trace span args)
        self._anchor: tuple | None = None  # CUDA, tracing: (event, its host time)
        self._cpu_span: tuple[float, float] | None = None  # CPU: the step's forward, not yet traced

    def attach(self, model: torch.nn.Module) -> None:
        """Time each forward of `model` (CPU: its start and end; CUDA: its start). Without a
        model (the null runner), each step's launch counts as its device work."""
        model.register_forward_pre_hook(lambda module, args: self.work_started())
        if not self._cuda:
            model.register_forward_hook(lambda module, args, out: self.work_ended())
        self._hooked = True
        if self._cuda and self._telemetry.trace is not None:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()  # once, before any step: the device is idle
            self._anchor = (anchor, time.perf_counter())

    def step_starting(self) -> None:
        # A start recorded outside a step (a forward at start-up: the memory profile, graph
        # capture) is stale: kept, it would stretch the first step back to start-up.
        self._args, self._start_event = None, None
        if not self._hooked:
            self.work_started()

    def name_step(self, args: dict) -> None:
        """The step being launched, for its trace span (step id, rows, tokens); before `step_launched`."""
        self._args = args

    def step_launched(self) -> None:
        if self._cuda or not self._hooked:
            self.work_ended()
        if self._cpu_span is not None:
            self._trace(*self._cpu_span, self._args)
            self._cpu_span = None

    def work_started(self) -> None:
        if self._cuda:
            if self._start_event is None:  # the first forward of the step (prompt logprobs may add more)
                self._start_event = torch.cuda.Event(enable_timing=True)
                self._start_event.record()
            self._collect()
        else:
            now = self._start = time.perf_counter()
            if self._last_end is not None:
                self._telemetry.timings.add("device_idle", now - self._last_end)
                self._last_end = None

    def work_ended(self) -> None:
        """CPU: the forward ended. CUDA: the step's device work is all enqueued."""
        if self._cuda:
            if self._start_event is None:
                return  # a step without device work
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._last_end_event, self._start_event, end, self._args))
            self._last_end_event, self._start_event = end, None
        else:
            self._last_end = time.perf_counter()
            if self._start is not None:
                self._telemetry.timings.add("device_step", self._last_end - self._start)
                self._cpu_span = (self._start, self._last_end)  # traced at `step_launched`, named
                self._start = None

    def _collect(self) -> None:
        timings = self._telemetry.timings
        while self._pending and self._pending[0][2].query():
            previous_end, start, end, args = self._pending.popleft()
            timings.add("device_step", start.elapsed_time(end) / 1e3)
            if previous_end is not None:
                timings.add("device_idle", previous_end.elapsed_time(start) / 1e3)
            if self._anchor is not None:
                anchor, host = self._anchor
                self._trace(host + anchor.elapsed_time(start) / 1e3, host + anchor.elapsed_time(end) / 1e3, args)

    def flush(self, wait: bool = False) -> None:
        """Read every pending pair whose events have completed; `wait`: every pending pair (at shutdown)."""
        if self._cuda and self._pending:
            if wait:
                self._pending[-1][2].synchronize()
            self._collect()

    def _trace(self, start_s: float, end_s: float, args: dict | None) -> None:
        trace = self._telemetry.trace
        if trace is not None:  # not `record`: the span must not count twice in the timings
            trace.add("device_step", start_s, end_s, args)
