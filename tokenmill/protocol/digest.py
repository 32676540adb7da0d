"""Debug digest of a step's batch: the scheduler's view, checked against each worker's mirror.

For every scheduled row, in batch order: handle, tokens computed once the step has run, and
the request's block ids; packed as little-endian int32 and folded with crc32. The scheduler
sends it every `debug_check_every` steps (`SchedulerOutput.digest`); a worker computes the
same from its own request states after launching the step and raises on a mismatch, which
ends the engine with `WorkerStateMismatchError`'s message.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tokenmill.protocol import SchedulerOutput

_ROW = struct.Struct("<iii")  # handle, num computed tokens, number of blocks


class WorkerStateMismatchError(RuntimeError):
    """A worker's mirrored request state diverged from the scheduler's."""


# A worker's view of one request: (tokens computed, block ids), or None when it holds no such request.
MirrorView = Callable[[int], "tuple[int, Sequence[int]] | None"]


def batch_digest(rows: Iterable[tuple[int, int, Sequence[int]]]) -> int:
    """crc32 over (handle, num_computed_tokens, block ids) per row, in row order."""
    crc = 0
    for handle, num_computed, blocks in rows:
        crc = zlib.crc32(_ROW.pack(handle, num_computed, len(blocks)), crc)
        crc = zlib.crc32(np.asarray(blocks, dtype="<i4").tobytes(), crc)
    return crc


def worker_digest(so: SchedulerOutput, view: MirrorView) -> int:
    """The digest of a worker's view, once `so` has been applied (launched)."""
    rows = []
    for handle in so.scheduled_handles:
        state = view(handle)
        if state is None:
            raise WorkerStateMismatchError(f"step {so.step_id}: the worker does not know scheduled request {handle}")
        rows.append((handle, *state))
    return batch_digest(rows)


def check_worker_view(so: SchedulerOutput, view: MirrorView) -> None:
    """Raise WorkerStateMismatchError when `so.digest` (if any) disagrees with the worker's `view`."""
    if so.digest is None:
        return
    mine = worker_digest(so, view)
    if mine != so.digest:
        raise WorkerStateMismatchError(
            f"debug check failed at step {so.step_id}: the worker's view of the {len(so.scheduled_handles)} "
            f"scheduled requests (tokens computed, block ids) differs from the scheduler's "
            f"(digest {mine:#010x} != {so.digest:#010x})")
