"""Apply a SchedulerOutput's diffs to a worker's mirror of its requests (shared by every runner)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tokenmill.protocol import NewRequestData, SchedulerOutput
from tokenmill.protocol.batch_diff import BatchOrder


class RequestMirror(Protocol):
    def drop(self, handle: int) -> None: ...

    def add(self, data: NewRequestData) -> None: ...

    def append_blocks(self, handle: int, block_ids: np.ndarray) -> None: ...


def apply_step_diffs(so: SchedulerOutput, batch_order: BatchOrder, mirror: RequestMirror) -> None:
    """Decode the batch, drop finished and preempted requests, add new ones, append new blocks."""
    batch_order.decode(so)
    for handle in so.finished_handles:
        mirror.drop(handle)
    for handle in so.preempted_handles:
        mirror.drop(handle)
    for data in so.new_requests:
        mirror.add(data)
    cached = so.cached_requests
    if cached is not None:
        handles = np.frombuffer(cached.handles, dtype="<i4")
        counts = np.frombuffer(cached.num_new_blocks, dtype="<i4")
        blocks = np.frombuffer(cached.new_block_ids, dtype="<i4")
        for handle, row_blocks in zip(handles.tolist(), np.split(blocks, np.cumsum(counts)[:-1])):
            mirror.append_blocks(handle, row_blocks)
