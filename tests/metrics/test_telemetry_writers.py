"""Telemetry counters keep one writer each: a reset from another thread (a utility handler, an
API thread) is a request that the counter's own writer acts on, never a write of its own."""

from __future__ import annotations

import sys
import threading

import pytest

from tokenmill.metrics import step_timings
from tokenmill.metrics import telemetry as telemetry_module
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import ChannelStats

ROUNDS, PER_ROUND, RESETS_PER_ROUND = 20, 200, 5
COUNTERS = {"count", "bytes_total", "bytes_last", "bytes_max", "encode_s", "decode_s", "_sizes", "_cleared_at",
            "seconds", "recent", "cleared_at"}


class WriterLog:
    """Which threads set each attribute of each watched object (after `clear()`)."""

    def __init__(self) -> None:
        self.writers: dict[tuple[int, str], set[str]] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.writers.clear()

    def watch(self, cls: type) -> type:
        log = self

        class Watched(cls):
            __slots__ = ()

            def __setattr__(self, name, value):
                with log._lock:
                    log.writers.setdefault((id(self), name), set()).add(threading.current_thread().name)
                object.__setattr__(self, name, value)

        return Watched


def test_reset_is_a_request_the_writer_acts_on() -> None:
    stats = MessageStats()
    for size in (10, 30, 20):
        stats.encoded(size, 0.001)
    stats.request_reset()
    assert stats.snapshot() == ChannelStats()  # reset, nothing counted since
    stats.encoded(7, 0.002)
    snap = stats.snapshot()
    assert (snap.count, snap.bytes_total, snap.bytes_max, snap.bytes_p50) == (1, 7, 7, 7)
    assert snap.encode_us == pytest.approx(2000.0)

    telemetry = Telemetry("test")
    telemetry.record("phase", 0.0, 1.0)
    telemetry.channel("c").decoded(5, 0.0)
    telemetry.reset()
    assert telemetry.snapshot().timings == {} and telemetry.snapshot().channels["c"] == ChannelStats()
    telemetry.record("phase", 0.0, 0.5)
    assert telemetry.snapshot().timings["phase"].count == 1
    assert telemetry.snapshot().timings["phase"].total_us == pytest.approx(5e5)


def test_each_counter_has_one_writing_thread(monkeypatch) -> None:
    """Two writers count while the main thread resets and snapshots (as a utility handler does
    in the engine core): each counter is written by its writer only, the reset requests by the
    main thread only."""
    log = WriterLog()
    monkeypatch.setattr(telemetry_module, "MessageStats", log.watch(MessageStats))
    monkeypatch.setattr(step_timings, "_Series", log.watch(step_timings._Series))
    monkeypatch.setattr(telemetry_module, "StepTimings", log.watch(step_timings.StepTimings))
    telemetry = Telemetry("test")
    # Made before the writers start, as the engine core does; what construction wrote is not counted.
    channels = {"input": telemetry.channel("requests"), "output": telemetry.channel("outputs")}
    log.clear()
    rounds = threading.Barrier(len(channels) + 1)

    def writer(name: str) -> None:
        for _ in range(ROUNDS):
            rounds.wait()
            for i in range(PER_ROUND):
                channels[name].decoded(i % 50, 1e-6)
                telemetry.record(f"{name}-phase", 0.0, 1e-6)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as the GIL allows
    threads = [threading.Thread(target=writer, args=(name,), name=name) for name in channels]
    try:
        for thread in threads:
            thread.start()
        for _ in range(ROUNDS):  # from the second round on, every counter exists while it is reset
            rounds.wait()
            for _ in range(RESETS_PER_ROUND):
                telemetry.reset()
                telemetry.snapshot()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    counters = {key: who for key, who in log.writers.items() if key[1] in COUNTERS}
    assert len({obj for obj, _ in counters}) == 4  # two channels, two phases
    for (obj, field), who in counters.items():
        assert len(who) == 1 and who <= {"input", "output"}, f"{field} written by {sorted(who)}"
    resets_by = set().union(*(who for (_, field), who in log.writers.items() if field == "_reset_at"))
    assert resets_by == {"MainThread"}
    # After the last reset, what the writers count next is all the counters hold.
    telemetry.reset()
    channels["input"].decoded(3, 0.0)
    snap = telemetry.snapshot()
    assert snap.channels["requests"].count == 1 and snap.channels["outputs"] == ChannelStats()
    assert snap.timings == {}
