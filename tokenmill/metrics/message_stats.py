"""Per-channel message counters: how many, how big, and how long encoding or decoding took.

Each process keeps one `MessageStats` per channel it touches (the sender counts encodes,
the receiver decodes); `merge_channels` joins the two sides' snapshots into one figure.
"""

from __future__ import annotations

from collections import deque

from tokenmill.protocol import ChannelStats

_RECENT = 4096  # message sizes kept for the median


class MessageStats:
    """One channel's counters on one side. See `tokenmill.metrics.telemetry` for who writes what:
    the counters only by the thread that sends or receives the messages, `_reset_at` only by
    whoever asks for a reset; a snapshot may be taken from any thread."""

    __slots__ = ("count", "bytes_total", "bytes_last", "bytes_max", "encode_s", "decode_s", "_sizes",
                 "_reset_at", "_cleared_at")

    def __init__(self) -> None:
        self._sizes: deque[int] = deque(maxlen=_RECENT)
        self._reset_at = 0  # resets asked for (written by the resetting thread only)
        self._clear()

    def request_reset(self) -> None:
        """Ask the writer to start counting afresh; until it counts again, snapshots read zero."""
        self._reset_at += 1

    def encoded(self, nbytes: int, seconds: float) -> None:
        self._count(nbytes)
        self.encode_s += seconds

    def decoded(self, nbytes: int, seconds: float) -> None:
        self._count(nbytes)
        self.decode_s += seconds

    def _clear(self) -> None:
        """The writer's half of a reset (called from `__init__` or the writer's thread)."""
        self._cleared_at = self._reset_at
        self.count = self.bytes_total = self.bytes_last = self.bytes_max = 0
        self.encode_s = self.decode_s = 0.0
        self._sizes.clear()

    def _count(self, nbytes: int) -> None:
        if self._cleared_at != self._reset_at:
            self._clear()
        self.count += 1
        self.bytes_total += nbytes
        self.bytes_last = nbytes
        if nbytes > self.bytes_max:
            self.bytes_max = nbytes
        self._sizes.append(nbytes)

    def snapshot(self) -> ChannelStats:
        if self._cleared_at != self._reset_at:
            return ChannelStats()  # reset, and nothing counted since
        sizes = sorted(list(self._sizes))  # one C call: the writer cannot append meanwhile
        return ChannelStats(count=self.count, bytes_total=self.bytes_total, bytes_last=self.bytes_last,
                            bytes_max=self.bytes_max, bytes_p50=sizes[len(sizes) // 2] if sizes else 0,
                            encode_us=self.encode_s * 1e6, decode_us=self.decode_s * 1e6)


def merge_channels(*sides: ChannelStats) -> ChannelStats:
    """One channel's sender and receiver snapshots as one: counts and sizes from the side that
    saw the most messages (the other may lag by the messages in flight), times added up."""
    if not sides:
        return ChannelStats()
    main = max(sides, key=lambda s: s.count)
    return ChannelStats(count=main.count, bytes_total=main.bytes_total, bytes_last=main.bytes_last,
                        bytes_max=max(s.bytes_max for s in sides), bytes_p50=main.bytes_p50,
                        encode_us=sum(s.encode_us for s in sides), decode_us=sum(s.decode_us for s in sides))
