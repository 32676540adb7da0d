"""Python's garbage collector in the engine's long-lived processes: its pauses in the step trace,
and the start-up heap frozen out of its way.

A collection stops the process that runs it (every thread: it holds the GIL). A full one walks
every container object alive, and after start-up a worker or the core holds a large, stable heap
(torch, transformers and tokenmill modules, the model's parameters, the step loop's structures):
~200k objects, a few milliseconds to tens of them. With pipeline parallelism the core and every
stage's worker are links of one closed loop, so a pause in any one of them idles every stage.

  trace_pauses   while a process traces its steps (`--trace-steps`), each collection of
                 generation 1 or 2 (and any of generation 0 that takes over `MIN_TRACED_S`) is a
                 `gc` event on the thread that ran it, with its generation and objects collected;
  freeze_heap    at the end of start-up: one full collection, then every object alive moves to
                 the permanent generation, which later collections skip (`gc.freeze`). Objects
                 made afterwards are collected as before. Off with TOKENMILL_GC_FREEZE=0.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

MIN_TRACED_S = 2e-4  # young collections shorter than this are not traced (there are thousands)
FREEZE_ENV = "TOKENMILL_GC_FREEZE"


def freeze_heap() -> int:
    """Collect once and freeze what is alive (unless TOKENMILL_GC_FREEZE=0); returns how many
    objects are frozen now (0 when off)."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def trace_pauses(add: Callable[[str, float, float, dict], None]) -> Callable[[], None]:
    """Record each collection through `add(name, start_s, end_s, args)` (a `StepTrace.add`);
    returns the function that stops it."""
    started: dict[int, float] = {}

    def callback(phase: str, info: dict) -> None:
        generation = info.get("generation", 0)
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        start = started.pop(generation, None)
        if start is None:
            return
        end = time.perf_counter()
        if generation > 0 or end - start >= MIN_TRACED_S:
            add("gc", start, end, {"generation": generation, "collected": info.get("collected", 0)})

    gc.callbacks.append(callback)

    def stop() -> None:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)
    return stop
