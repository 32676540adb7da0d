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


def script_spec_cost(llm, ratio_at_step) -> list[tuple[bool, int, int]]:
    """Feed the adaptive policy a fixed speculative/plain step-time ratio per step
    (`ratio_at_step(step_id)`), every regime counted as measured, so that a test chooses when
    speculating pays and when it does not. Returns the observations the scheduler passes on
    (`Scheduler.observe_step`): (speculative, rows, step_id), recorded, not used."""
    from tokenmill.core.spec_cost import StepCosts

    scheduler = llm.engine.scheduler
    observed: list[tuple[bool, int, int]] = []

    class Scripted(StepCosts):
        def observe(self, speculative: bool, num_rows: int, seconds: float, step_id: int) -> None:
            observed.append((speculative, num_rows, step_id))

        def ratio(self, num_rows: int) -> float:
            return ratio_at_step(scheduler.step_id)

        def untried(self, speculative: bool, num_rows: int) -> bool:
            return False

        def stale(self, speculative: bool, num_rows: int, step_id: int) -> bool:
            return False

    policy = scheduler.spec
    policy.costs = Scripted(policy.table.max_rows)
    return observed
