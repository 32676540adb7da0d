"""The one place tests reach into the worker of a single-process engine: a refactor of the
executor or worker changes only this function."""

from __future__ import annotations


def worker_runner(llm):
    """The ModelRunner behind `LLM(..., single_process=True)` (its states, sampler, counters)."""
    return llm.engine.executor.worker.runner


def pin_spec_cost(llm, ratio: float = 1.0) -> None:
    """Fix the adaptive policy's speculative/plain step-time ratio (spec_cost.py) of a
    single-process engine: it then drafts by acceptance and load alone, whatever the timings of
    a busy test machine (tests of the measured ratio itself leave it alone)."""
    from tokenmill.core.spec_cost import StepCosts

    class Pinned(StepCosts):
        def observe(self, *args) -> None:
            pass

        def ratio(self, num_rows: int) -> float:
            return ratio

        def untried(self, speculative: bool, num_rows: int) -> bool:
            return False

        def stale(self, speculative: bool, num_rows: int, step_id: int) -> bool:
            return False

    policy = llm.engine.scheduler.spec
    policy.costs = Pinned(policy.table.max_rows)
