"""The one place tests reach into the worker of a single-process engine: a refactor of the
executor or worker changes only this function."""

from __future__ import annotations


def worker_runner(llm):
    """The ModelRunner behind `LLM(..., single_process=True)` (its states, sampler, counters)."""
    return llm.engine.executor.worker.runner
