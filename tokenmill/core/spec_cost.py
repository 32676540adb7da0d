"""What a speculative step costs against a plain one, measured (see spec_policy.py).

A step that verifies drafts feeds 1 + k tokens per drafting row (1 + K for every row through
CUDA's padded verification graph) and runs the proposer at its end. It pays off only if the
tokens it adds beat the time it adds, and that depends on the model, the batch size and the
machine: a small model at a small batch is bound by host work, a large one by reading its
weights. So the engine core times every step (busy time: from the end of the previous step's
update to the end of this one's) and `StepCosts` keeps a running mean per padded batch size for
the two regimes the policy chooses between: plain steps (no drafts verified, none proposed)
and speculative steps (drafts verified, more proposed). Steps with prompt chunks, and steps
between the regimes, are not counted. Until both regimes are measured at a size, the ratio is
`PRIOR_RATIO`.
"""

from __future__ import annotations

import math

import numpy as np

from tokenmill.padded_batches import graph_batch_sizes, padded_index

PRIOR_RATIO = 1.3  # a speculative step's time over a plain one's, before both are measured
WEIGHT = 0.2  # of a new measurement in a running mean
REFRESH_STEPS = 256  # an estimate older than this many steps is measured again when a choice is close


class StepCosts:
    def __init__(self, max_rows: int) -> None:
        self.sizes = graph_batch_sizes(max_rows)
        self.seconds = np.full((2, len(self.sizes)), math.nan)  # [plain, speculative] per size
        self.measured_at = np.full((2, len(self.sizes)), -math.inf)  # the step of the last measurement

    def observe(self, speculative: bool, num_rows: int, seconds: float, step_id: int) -> None:
        kind, size = int(speculative), padded_index(self.sizes, num_rows)
        old = self.seconds[kind, size]
        self.seconds[kind, size] = seconds if math.isnan(old) else old + WEIGHT * (seconds - old)
        self.measured_at[kind, size] = step_id

    def ratio(self, num_rows: int) -> float:
        """A speculative step's time over a plain one's at this batch size."""
        plain, speculative = self.seconds[:, padded_index(self.sizes, num_rows)]
        return PRIOR_RATIO if math.isnan(plain) or math.isnan(speculative) else speculative / plain

    def claim(self, speculative: bool, num_rows: int, step_id: int) -> None:
        """A measurement of this regime at this size is under way: not stale until REFRESH_STEPS
        from now, whether or not it lands (a step with a prompt chunk is not counted)."""
        self.measured_at[int(speculative), padded_index(self.sizes, num_rows)] = step_id

    def untried(self, speculative: bool, num_rows: int) -> bool:
        """Whether this regime has never been measured (or tried) at this batch size."""
        return self.measured_at[int(speculative), padded_index(self.sizes, num_rows)] == -math.inf

    def stale(self, speculative: bool, num_rows: int, step_id: int) -> bool:
        """Whether this regime's time at this batch size is unmeasured or old."""
        return step_id - self.measured_at[int(speculative), padded_index(self.sizes, num_rows)] > REFRESH_STEPS
