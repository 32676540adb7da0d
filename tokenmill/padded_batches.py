"""The batch sizes a decode step is padded to (one CUDA graph each): the worker captures its
graphs at these sizes, and the scheduler's step-cost estimates are kept per size, since every
batch padded to the same size costs the device the same."""

from __future__ import annotations

import bisect


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def padded_index(sizes: list[int], num_rows: int) -> int:
    """Index in `sizes` (ascending) of the smallest that holds `num_rows` (the last if none does)."""
    return min(bisect.bisect_left(sizes, num_rows), len(sizes) - 1)
