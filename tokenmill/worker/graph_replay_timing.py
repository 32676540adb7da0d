"""Device time of a captured CUDA graph's replay: the one event loop every graph timer shares.

The worker uses it at start-up to keep only the decode-graph families that pay; the benchmarks'
kernel timer (`benchmarks/graph_timing.graph_us`) builds on it.
"""

from __future__ import annotations

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of `graph`, after one warm replay outside the timed loop."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
