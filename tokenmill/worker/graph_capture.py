"""One CUDA graph per padded size: capturing them, choosing one, and replaying one over a row buffer
(what every graph family of the worker shares)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

Output = TypeVar("Output")


def capture_per_size(sizes: Iterable[int], body: Callable[[int], Output]
                     ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Output]]:
    """A graph of `body(size)` for each size, largest first, all in one memory pool, on a side
    stream. Each body runs once before its capture (kernels compile, the allocator settles).
    Returns the graphs and what each captured body returned (static tensors a replay rewrites)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Output] = {}
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            body(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[size] = body(size)
            graphs[size] = graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, outputs


def smallest_fitting(sizes: Iterable[int], n: int) -> int | None:
    """The smallest of `sizes` that holds `n`; None when none does."""
    return min((s for s in sizes if s >= n), default=None)


def replay_over_rows(graphs: dict[int, torch.cuda.CUDAGraph], buffer: torch.Tensor, rows: torch.Tensor,
                     scratch: int) -> bool:
    """Replay the smallest graph of `graphs` that holds `rows` (int64 slots), its body reading
    `buffer[:size]`: the rows are loaded there first, padded with the `scratch` slot (nothing to
    load when `rows` is a prefix view of `buffer`, padded already). False: no graph fits."""
    n = rows.shape[0]
    size = smallest_fitting(graphs, n)
    if size is None:
        return False
    if rows.data_ptr() != buffer.data_ptr():
        buffer[:n].copy_(rows)
        buffer[n:size].fill_(scratch)
    graphs[size].replay()
    return True
