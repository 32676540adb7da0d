"""A torch.profiler window over a worker's decode steps, for benchmarks only: off unless the worker
process starts with TOKENMILL_DEVICE_PROFILE set (JSON of a `ProfileWindow`). No engine argument or
request field reaches it.

The window holds whole decode steps of a full batch (`batch` rows, one token each, so graph
replays): after the launch of the `skip`-th such step it synchronizes the device and starts the
profiler; after the launch of each later one it enqueues a marker kernel (`torch.cuda._sleep`, a
`spin_kernel` of a few cycles) behind the step's device work, so the device timeline can be cut
into steps marker to marker (tokenmill/benchmarks/step_profile.py reads the file); after the
`steps`-th marker it synchronizes and stops. The rank writes `<out_dir>/rank<rank>.json`: every
device event (name, start, duration in microseconds) and the host's wall time per step with and
without the profiler running. While the window is open, torch's CUDA sync debug mode is on
("warn"): every operation that makes the host wait for the device (`.item()`, a blocking copy, a
`nonzero`) is counted with the source line that called it (`host_syncs`); a step that
never blocks the host has none.

    TOKENMILL_DEVICE_PROFILE='{"out_dir": "/tmp/prof", "batch": 1, "skip": 64, "steps": 32}'

`min_tokens` > 0 holds steps of at least that many tokens instead (prefill chunks, whatever
their rows). A JSON list of windows opens them in turn (each its own `out_dir`; a window does not
open while another is): a prefill window and a decode window in one run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

import msgspec

ENV_VAR = "TOKENMILL_DEVICE_PROFILE"
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: the start of each profiled step
_MARKER_CYCLES = 16


class ProfileWindow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    out_dir: str
    batch: int = 1  # rows of the steps profiled (each one decode token)
    skip: int = 64  # such steps before the window (warm graphs, steady state)
    steps: int = 32  # steps in the window
    min_tokens: int = 0  # > 0: the steps held are those of at least this many tokens (not `batch`)


class DeviceProfile:
    def __init__(self, window: ProfileWindow, rank: int, device) -> None:
        self.window, self.rank, self.device = window, rank, device
        self._seen = 0
        self._prof = None
        self._plain_start = 0.0
        self._plain_s = 0.0
        self._start = 0.0
        self._done = False
        self._syncs: dict[str, int] = {}  # "file:line" of each synchronizing call -> count
        self._showwarning = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], rank: int, device) -> DeviceProfile | None:
        raw = environ.get(ENV_VAR)
        if not raw:
            return None
        if raw.lstrip().startswith("["):
            windows = msgspec.json.decode(raw.encode(), type=list[ProfileWindow])
            return DeviceProfiles([cls(w, rank, device) for w in windows])
        return cls(msgspec.json.decode(raw.encode(), type=ProfileWindow), rank, device)

    @property
    def open(self) -> bool:
        return self._prof is not None

    def holds(self, batch_counts) -> bool:
        """Whether a step of these per-row token counts is one of the window's kind."""
        w = self.window
        if w.min_tokens > 0:
            return int(batch_counts.sum()) >= w.min_tokens
        return len(batch_counts) == w.batch and int(batch_counts.sum()) == w.batch

    def after_launch(self, batch_counts) -> None:
        """Called after a step's launch with its per-row token counts."""
        w = self.window
        if self._done or not self.holds(batch_counts):
            return
        import torch
        cuda = self.device.type == "cuda"
        self._seen += 1
        n = self._seen
        if n == w.skip // 2:
            self._plain_start = time.perf_counter()
        if n == w.skip:
            self._plain_s = (time.perf_counter() - self._plain_start) / max(w.skip - w.skip // 2, 1)
            self._sync()
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            self._prof = torch.profiler.profile(activities=[activity])
            self._prof.start()
            self._start = time.perf_counter()
            self._watch_syncs(True)
            return
        if self._prof is None:
            return
        if cuda:
            torch.cuda._sleep(_MARKER_CYCLES)
        if n == w.skip + w.steps:
            self._watch_syncs(False)
            self._sync()
            wall = (time.perf_counter() - self._start) / w.steps
            self._prof.stop()
            self._done = True
            self._write(wall)
            self._prof = None

    def _watch_syncs(self, on: bool) -> None:
        """CUDA: count the synchronizing calls made while the window is open (sync debug mode)."""
        import warnings

        import torch
        if self.device.type != "cuda":
            return
        if on:
            self._showwarning = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                if "synchronizing CUDA operation" in str(message):
                    key = f"{filename}:{lineno}"
                    self._syncs[key] = self._syncs.get(key, 0) + 1
                else:
                    self._showwarning(message, category, filename, lineno, file, line)
            warnings.showwarning = record
            self._filters = warnings.filters[:]
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._showwarning
            warnings.filters[:] = self._filters

    def _sync(self) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, wall_s: float) -> None:
        import torch
        events = []
        for evt in self._prof.events():
            on_device = evt.device_type == torch.autograd.DeviceType.CUDA
            if on_device or self.device.type != "cuda":
                events.append([evt.name, float(evt.time_range.start), float(evt.time_range.elapsed_us())])
        events.sort(key=lambda e: e[1])
        record = {"rank": self.rank, "device": str(self.device), "steps": self.window.steps,
                  "batch": self.window.batch, "min_tokens": self.window.min_tokens, "marker": MARKER, "wall_ms_per_step": 1e3 * wall_s,
                  "wall_ms_per_step_unprofiled": 1e3 * self._plain_s,
                  "host_syncs": self._syncs if self.device.type == "cuda" else None,  # (not watched on CPU)
                  "events": events}
        os.makedirs(self.window.out_dir, exist_ok=True)
        with open(os.path.join(self.window.out_dir, f"rank{self.rank}.json"), "w") as f:
            json.dump(record, f)


class DeviceProfiles:
    """Several windows, opened in turn: a step goes to the open window, else to each closed one
    (so that each counts its skipped steps); a window does not open while another is."""

    def __init__(self, profiles: list[DeviceProfile]) -> None:
        self.profiles = profiles

    def after_launch(self, batch_counts) -> None:
        active = next((p for p in self.profiles if p.open), None)
        if active is not None:
            active.after_launch(batch_counts)
            return
        for p in self.profiles:
            p.after_launch(batch_counts)
            if p.open:
                return
