"""Apply a SchedulerOutput's diffs to a worker's per-request mirror (shared by every runner)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.protocol import NewRequestData, SchedulerOutput


def apply_step_diffs(so: SchedulerOutput, batch_order: BatchOrder, states: dict[int, Any],
                     new_state: Callable[[NewRequestData], Any]) -> None:
    """Decode the batch, drop finished and preempted requests, add new ones, append new blocks.

    Each state must have a `block_ids` list."""
    batch_order.decode(so)
    for handle in so.finished_handles:
        states.pop(handle, None)
    for handle in so.preempted_handles:
        states.pop(handle, None)
    for data in so.new_requests:
        states[data.handle] = new_state(data)
    if so.cached_requests is not None:
        for handle, blocks in so.cached_requests.rows():
            states[handle].block_ids.extend(blocks)
