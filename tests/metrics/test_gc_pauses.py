"""`metrics/gc_pauses`: the collector's pauses reach the step trace, and the start-up heap is frozen."""

from __future__ import annotations

import gc

from tokenmill.metrics.gc_pauses import FREEZE_ENV, freeze_heap, trace_pauses


def test_collections_are_traced_until_stopped() -> None:
    events = []
    stop = trace_pauses(lambda name, start, end, args: events.append((name, end - start, args)))
    try:
        gc.collect(2)
    finally:
        stop()
    full = [e for e in events if e[0] == "gc" and e[2]["generation"] == 2]
    assert len(full) == 1 and full[0][1] >= 0
    gc.collect(2)
    assert len([e for e in events if e[2]["generation"] == 2]) == 1, "traced after its stop"


def test_freeze_moves_the_heap_to_the_permanent_generation(monkeypatch) -> None:
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert freeze_heap() == 0 and gc.get_freeze_count() == 0
    monkeypatch.delenv(FREEZE_ENV)
    try:
        kept = [object() for _ in range(10)]
        assert freeze_heap() >= len(kept)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
