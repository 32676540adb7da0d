"""How long the device sits idle between steps: from the end of step N's device work to the
start of step N+1's forward.

CUDA: an event recorded when the model's forward starts (a forward pre-hook) and one recorded
after the step is launched (behind its sampling and read-back copy); each gap is read once
both events have completed, so measuring never synchronizes the device. CPU (and the null
model): host clock at the start and end of each forward. Gaps go to `timings["device_idle"]`.
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
        self._last_end_event = None  # CUDA
        self._gaps: deque[tuple] = deque()  # CUDA (end event, start event) pairs not yet read
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
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            if self._last_end_event is not None:
                self._gaps.append((self._last_end_event, start))
                self._last_end_event = None
            self._collect()
        else:
            now = time.perf_counter()
            if self._last_end is not None:
                self._telemetry.timings.add("device_idle", now - self._last_end)
                self._last_end = None

    def work_ended(self) -> None:
        """CPU: the forward ended. CUDA: the step's device work is all enqueued."""
        if self._cuda:
            self._last_end_event = torch.cuda.Event(enable_timing=True)
            self._last_end_event.record()
        else:
            self._last_end = time.perf_counter()

    def _collect(self) -> None:
        while self._gaps and self._gaps[0][1].query():
            end, start = self._gaps.popleft()
            self._telemetry.timings.add("device_idle", end.elapsed_time(start) / 1e3)
