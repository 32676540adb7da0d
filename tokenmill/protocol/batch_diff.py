"""The step's batch as a diff against the previous step's, kept identically on both sides.

The scheduler encodes (which requests, how many tokens each) into a BatchDiff and
the workers decode it; both hold the previous batch, so a steady decode step,
where every row stays and schedules one token, costs no bytes at all.
Invariant: every encoded diff is decoded exactly once, in order.
"""

from __future__ import annotations

from tokenmill.protocol import BatchDiff, SchedulerOutput, pack_ids, unpack_ids


class BatchOrder:
    def __init__(self) -> None:
        self.handles: list[int] = []

    def encode(self, so: SchedulerOutput, scheduled: dict[int, int]) -> None:
        """Set `so.batch` from {handle: num_tokens} (any order), and the local views on `so`."""
        prev = self.handles
        removed = [i for i, h in enumerate(prev) if h not in scheduled]
        kept = [h for h in prev if h in scheduled]
        kept_set = set(kept)
        added = [h for h in scheduled if h not in kept_set]
        handles = kept + added
        counts = [scheduled[h] for h in handles]
        odd = [i for i, n in enumerate(counts) if n != 1]
        diff = BatchDiff(count_rows=pack_ids(odd), count_values=pack_ids([counts[i] for i in odd]))
        if len(removed) + len(added) <= len(handles):
            diff.removed_rows, diff.added = pack_ids(removed), pack_ids(added)
        else:
            diff.full = pack_ids(handles)
        so.batch = None if diff == BatchDiff() else diff
        self._set(so, handles, counts)

    def decode(self, so: SchedulerOutput) -> None:
        """Rebuild the batch from `so.batch` and set the local views on `so`."""
        diff = so.batch or BatchDiff()
        if diff.full is not None:
            handles = unpack_ids(diff.full)
        else:
            removed = set(unpack_ids(diff.removed_rows))
            handles = [h for i, h in enumerate(self.handles) if i not in removed]
            handles.extend(unpack_ids(diff.added))
        counts = [1] * len(handles)
        for row, n in zip(unpack_ids(diff.count_rows), unpack_ids(diff.count_values)):
            counts[row] = n
        self._set(so, handles, counts)

    def _set(self, so: SchedulerOutput, handles: list[int], counts: list[int]) -> None:
        self.handles = handles
        so.scheduled_handles = handles
        so.num_scheduled_tokens = counts
        so.total_num_scheduled_tokens = sum(counts)
