"""Kernel timing through CUDA graph replay: the one capture-and-replay timer the GPU scripts share.

A graph holding `calls` back-to-back calls of `fn` is captured once on a side stream (after `warmup`
eager calls there, so Triton compiles and allocators settle outside the capture), replayed once to
warm, then `replays` times between two CUDA events (`worker/graph_replay_timing.replay_ms`). Replay removes the launch overhead, so the
figure is the kernels' device time per call.
"""

from __future__ import annotations

from typing import Callable

import torch

from tokenmill.worker.graph_replay_timing import replay_ms


def graph_us(fn: Callable[[], object], calls: int = 1, replays: int = 20, warmup: int = 3) -> float:
    """Microseconds of device time per call of `fn`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_ms(graph, replays) * 1000 / calls
