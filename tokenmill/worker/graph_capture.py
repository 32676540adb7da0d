"""Capturing one CUDA graph per padded size: the loop every graph family of the worker shares."""

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
