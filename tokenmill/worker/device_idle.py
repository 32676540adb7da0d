"""How long the device works on each step, and how long it sits idle between steps.

A step's device work runs from the start of its forward (a model pre-hook, or the runner's
`on_device_work` call before a CUDA graph replay) to the end of its sampling and read-back copy.
CUDA: events recorded at both ends; a pair is read only once its events have completed, so
measuring never synchronizes the device. CPU (and the null model): the host clock around the
forward. Durations go to `timings["device_step"]` and `timings["device_idle"]`; per pipeline
stage, they give its busy time and its bubble (`tokenmill.metrics.pipeline`).
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
        self._pending: deque[tuple] = deque()  # CUDA (previous end | None, start, end) not yet read
        self._hooked = False

    def attach(self, model: torch.nn.Module) -> None:
        """Time each forward of `model` (CPU: its start and end; CUDA: its start). Without a
        model (the null runner), each step's launch counts as its device work."""
        model.register_forward_pre_hook(lambda module, args: self.work_started())
        if not self._cuda:
            model.register_forward_hook(lambda module, args, out: self.work_ended())
        self._hooked = True

    def step_starting(self) -> None:
        if not self._hooked:
            self.work_started()

    def step_launched(self) -> None:
        if self._cuda or not self._hooked:
            self.work_ended()

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
            self._pending.append((self._last_end_event, self._start_event, end))
            self._last_end_event, self._start_event = end, None
        else:
            self._last_end = time.perf_counter()
            if self._start is not None:
                self._telemetry.timings.add("device_step", self._last_end - self._start)
                self._start = None

    def _collect(self) -> None:
        timings = self._telemetry.timings
        while self._pending and self._pending[0][2].query():
            previous_end, start, end = self._pending.popleft()
            timings.add("device_step", start.elapsed_time(end) / 1e3)
            if previous_end is not None:
                timings.add("device_idle", previous_end.elapsed_time(start) / 1e3)
