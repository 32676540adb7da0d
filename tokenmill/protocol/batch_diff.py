"""The step's batch as a diff against the previous step's, kept identically on both sides.

The scheduler encodes (which requests, how many tokens each) into a BatchDiff and
the workers decode it; both hold the previous batch, so a steady decode step,
where every row stays and schedules one token, costs no bytes at all.
Both sides keep the batch as numpy arrays, so a step costs O(changes) Python work.
Invariant: every encoded diff is decoded exactly once, in order.
"""

from __future__ import annotations

import numpy as np

from tokenmill.protocol import BatchDiff, SchedulerOutput

_I32 = np.dtype("<i4")


def _pack(values: np.ndarray) -> bytes:
    return values.astype(_I32, copy=False).tobytes()


def _unpack(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_I32)


class BatchOrder:
    def __init__(self) -> None:
        self.handles: np.ndarray = np.empty(0, _I32)  # the current batch, in row order
        self._ones: np.ndarray = np.ones(0, _I32)  # counts of a batch of one-token rows (read-only)

    def encode(self, so: SchedulerOutput, kept: np.ndarray, added: np.ndarray, counts: np.ndarray) -> None:
        """Set `so.batch` and the local views on `so`.

        `kept`: bool per row of the previous batch, True if the row stays (in its order);
        `added`: handles appended after the kept rows, in order; `counts`: tokens per row of
        the new batch (kept rows, then added ones)."""
        removed = np.flatnonzero(~kept)
        handles = self.handles
        if removed.size or added.size:
            handles = np.concatenate([handles[kept], added.astype(_I32, copy=False)])
        odd = np.flatnonzero(counts != 1)
        diff = BatchDiff()
        if odd.size:
            diff.count_rows, diff.count_values = _pack(odd), _pack(counts[odd])
        if removed.size + added.size > len(handles):
            diff.full = _pack(handles)
        elif removed.size or added.size:
            diff.removed_rows, diff.added = _pack(removed), _pack(added)
        so.batch = diff if odd.size or diff.full is not None or removed.size or added.size else None
        self._set(so, handles, counts if odd.size else self._all_ones(len(handles)))

    def encode_same_rows(self, so: SchedulerOutput) -> None:
        """`encode` for a batch of the previous rows, one token each (nothing on the wire)."""
        so.batch = None
        self._set(so, self.handles, self._all_ones(len(self.handles)))

    def decode(self, so: SchedulerOutput) -> None:
        """Rebuild the batch from `so.batch` and set the local views on `so`."""
        diff = so.batch
        if diff is None:
            self._set(so, self.handles, self._all_ones(len(self.handles)))
            return
        if diff.full is not None:
            handles = _unpack(diff.full)
        elif diff.removed_rows or diff.added:
            keep = np.ones(len(self.handles), bool)
            keep[_unpack(diff.removed_rows)] = False
            handles = np.concatenate([self.handles[keep], _unpack(diff.added)])
        else:
            handles = self.handles
        counts = self._all_ones(len(handles))
        if diff.count_rows:
            counts = counts.copy()
            counts[_unpack(diff.count_rows)] = _unpack(diff.count_values)
        self._set(so, handles, counts)

    def _all_ones(self, n: int) -> np.ndarray:
        if len(self._ones) != n:
            self._ones = np.ones(n, _I32)
            self._ones.flags.writeable = False
        return self._ones

    def _set(self, so: SchedulerOutput, handles: np.ndarray, counts: np.ndarray) -> None:
        self.handles = handles
        so.batch_handles = handles
        so.batch_counts = counts
        so.total_num_scheduled_tokens = int(counts.sum()) if counts is not self._ones else len(counts)
