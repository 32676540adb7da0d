"""The worker's real graph capture (`ModelRunner.capture_graphs`) on CPU, with an eager replay.

Every graph family captures through `graph_capture.capture_per_size`; here that function is
replaced (monkeypatch, no hook in tokenmill) by one that does what it does on CUDA except the
recording: each body runs once to warm up and once "captured", and the returned static outputs
are the ones the families keep. A replay runs the body again and writes its result into those
static outputs, as a CUDA graph replay rewrites them. So the construction that runs on the GPU
(which families, their sizes, row buffers, mirrors, histories, stage layout) is the code under
test, and only the recording is skipped.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

from tokenmill.worker import graph_capture


# The modules whose graphs ModelRunner.capture_graphs captures (a new one belongs here).
GRAPH_FAMILIES = ("tokenmill.worker.decode_graphs", "tokenmill.worker.greedy_tail", "tokenmill.worker.prompt_graphs",
                  "tokenmill.worker.speculator", "tokenmill.worker.draft_proposer")


class EagerGraph:
    """A captured graph stand-in: `replay` reruns the body into the captured outputs."""

    def __init__(self, body: Callable[[], object], outputs) -> None:
        self.body, self.outputs, self.replays = body, outputs, 0

    def replay(self) -> None:
        _copy_into(self.outputs, self.body())
        self.replays += 1


def _copy_into(static, fresh) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (list, tuple)):
        assert len(static) == len(fresh)
        for s, f in zip(static, fresh):
            _copy_into(s, f)
    else:
        assert static is None and fresh is None, f"a graph body returned {type(fresh)}"


def eager_capture_per_size(sizes, body):
    """`capture_per_size` without CUDA: same order (largest first), same warm-up run."""
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        body(size)
        outputs[size] = body(size)
        graphs[size] = EagerGraph(lambda size=size: body(size), outputs[size])
    return graphs, outputs


def use_eager_capture(monkeypatch) -> None:
    """Route every module of tokenmill that imported `capture_per_size` to the eager one."""
    for family in GRAPH_FAMILIES:  # imported first, so that none is missed
        importlib.import_module(family)
    real = graph_capture.capture_per_size
    patched = [name for name, module in list(sys.modules.items())
               if name.startswith("tokenmill.") and getattr(module, "capture_per_size", None) is real]
    for name in patched:
        monkeypatch.setattr(sys.modules[name], "capture_per_size", eager_capture_per_size)
    assert set(GRAPH_FAMILIES) <= set(patched), patched


def capture_real_graphs(llm, monkeypatch, verify_rows: int | None = None):
    """Run the real `ModelRunner.capture_graphs` of a single-process engine on CPU, with eager
    replays. `verify_rows`: cap the verification graphs' batch (VERIFY_GRAPH_ROWS) so that
    larger batches run eagerly. Returns the runner."""
    from tests.helpers.engine import worker_runner
    from tokenmill.worker import graph_families
    use_eager_capture(monkeypatch)
    if verify_rows is not None:
        monkeypatch.setattr(graph_families, "VERIFY_GRAPH_ROWS", verify_rows)
    runner = worker_runner(llm)
    runner.capture_graphs()
    return runner


def replays(family) -> int:
    """How many times a family's graphs were replayed (DecodeGraphs, GreedyTail, PromptGraphs,
    the speculator or the draft: wherever its graphs dict lives)."""
    if family is None:
        return 0
    graphs = next(getattr(family, name) for name in ("graphs", "_graphs") if isinstance(getattr(family, name, None), dict))
    return sum(g.replays for g in graphs.values())
