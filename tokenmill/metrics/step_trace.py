"""Chrome / Perfetto trace of each process's step timeline (`--trace-steps FILE`).

Every process records complete ("X") events in memory and writes them, when it stops, to
`FILE.<role>.json`; the front-end, which stops last, merges the parts it finds into FILE
(one track per process, one row per thread) and removes them. Timestamps come from
`time.perf_counter()`, CLOCK_MONOTONIC on Linux, so they line up across processes.
Open FILE in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

_MAX_EVENTS = 500_000  # per process; later events are dropped (and counted)


def part_path(path: str, role: str) -> str:
    return f"{path}.{role}.json"


class StepTrace:
    def __init__(self, path: str, role: str, label: str | None = None) -> None:
        self.path = path
        self.role = role
        self.label = label or role
        self._events: list[tuple] = []  # (name, start_s, dur_s, tid, args)
        self._threads: dict[int, str] = {}
        self._dropped: dict[int, int] = {}  # per recording thread, each written by its own thread

    @property
    def dropped(self) -> int:
        return sum(list(self._dropped.values()))

    def add(self, name: str, start_s: float, end_s: float, args: dict | None = None) -> None:
        tid = threading.get_native_id()
        if len(self._events) >= _MAX_EVENTS:
            self._dropped[tid] = self._dropped.get(tid, 0) + 1
            return
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        self._events.append((name, start_s, end_s - start_s, tid, args))

    def write_part(self) -> None:
        """Write this process's events to FILE.<role>.json (no-op without events)."""
        if not self._events:
            return
        events = [{"name": n, "ph": "X", "ts": s * 1e6, "dur": d * 1e6, "tid": t, **({"args": a} if a else {})}
                  for n, s, d, t, a in self._events]
        part = {"role": self.role, "label": self.label, "pid": os.getpid(),
                "threads": {str(k): v for k, v in self._threads.items()},
                "dropped": self.dropped, "events": events}
        tmp = part_path(self.path, self.role) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(part, f)
        os.replace(tmp, part_path(self.path, self.role))
        self._events = []


def merge_parts(path: str, roles: list[str]) -> int:
    """Merge the parts written for `roles` into `path` (a Chrome trace); returns how many
    processes it holds. Each process gets its own pid (its place in `roles`), named after its role."""
    trace: list[dict] = []
    found = 0
    for index, role in enumerate(roles, start=1):
        part_file = Path(part_path(path, role))
        if not part_file.exists():
            continue
        part = json.loads(part_file.read_text())
        part_file.unlink()
        found += 1
        trace.append({"name": "process_name", "ph": "M", "pid": index, "tid": 0,
                      "args": {"name": f"{part.get('label', role)} (pid {part['pid']})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": index, "tid": 0,
                      "args": {"sort_index": index}})
        for tid, name in part["threads"].items():
            trace.append({"name": "thread_name", "ph": "M", "pid": index, "tid": int(tid),
                          "args": {"name": name}})
        for event in part["events"]:
            event["pid"] = index
            trace.append(event)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    return found


def remove_stale_parts(path: str, roles: list[str]) -> None:
    for role in roles:
        try:
            os.unlink(part_path(path, role))
        except FileNotFoundError:
            pass
