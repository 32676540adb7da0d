"""Faults injected into a worker, for tests only: off unless the worker process starts with
TOKENMILL_TEST_FAULTS set. `worker_proc.main` reads it once; no engine argument, flag or
request field reaches it, so nothing a client sends can turn a fault on.

The variable holds a `FaultPlan` as JSON. Each fault has a `Trigger`: its victims are the
requests whose prompt starts with `marker_token`, and it fires on a step holding a victim
with at least `after` output tokens computed (0: from its first sampled token on):
- `nan_logits`: the victim's row of logits turns NaN (a row-level fault);
- `sampling_error`: sampling a batch holding the victim raises (a row-level fault);
- `step_error`: the step raises before its forward pass (the worker fails: fatal).
A `ShardSwap` is no trigger but a load-time fault: `wrong_shard` swaps two rows of one
parameter on one rank after loading (a planted parallelism bug for the layout check,
tokenmill/benchmarks/layout_check.py).

    TOKENMILL_TEST_FAULTS='{"nan_logits": {"marker_token": 7, "after": 3}}'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # the worker's entry point reads the plan before torch is imported
    import numpy as np
    import torch

    from tokenmill.worker.model_runner import ModelRunner

ENV_VAR = "TOKENMILL_TEST_FAULTS"


class Trigger(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    marker_token: int  # victims: requests whose prompt starts with this token id
    after: int = 0  # fire once a victim has this many output tokens computed


class ShardSwap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int  # the worker rank whose shard goes wrong
    parameter: str  # the first of its parameters whose name ends with this
    rows: tuple[int, int] = (0, 1)  # the first local rows of the two blocks swapped
    count: int = 1  # rows per block (a head's rows: head_dim)


class FaultPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nan_logits: Trigger | None = None
    sampling_error: Trigger | None = None
    step_error: Trigger | None = None
    wrong_shard: ShardSwap | None = None


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


class FaultInjector:
    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultInjector | None:
        text = environ.get(ENV_VAR)
        return cls(msgspec.json.decode(text, type=FaultPlan)) if text else None

    def after_load(self, model: torch.nn.Module, rank: int) -> None:
        """`wrong_shard` on its rank: two blocks of rows of the named parameter trade places, in
        place (packed copies follow the weight's version; CUDA graphs read the same storage)."""
        import torch
        swap = self.plan.wrong_shard
        if swap is None or swap.rank != rank:
            return
        param = next((p for n, p in model.named_parameters() if n.endswith(swap.parameter)), None)
        if param is None:
            raise ValueError(f"wrong_shard.parameter: rank {rank} has no parameter ending with {swap.parameter!r}")
        a, b = (torch.arange(r, r + swap.count) for r in swap.rows)
        with torch.no_grad():
            param[torch.cat([a, b])] = param[torch.cat([b, a])].clone()

    def poison_logits(self, runner: ModelRunner, logits: torch.Tensor, slots: torch.Tensor) -> None:
        """Sampling rows' logits, before the screen: the victims' rows become NaN."""
        rows = _victims(runner, slots, self.plan.nan_logits)
        if rows:
            logits[rows] = float("nan")

    def before_sampling(self, runner: ModelRunner, slots: torch.Tensor) -> None:
        if _victims(runner, slots, self.plan.sampling_error):
            raise InjectedFault("injected sampling fault")

    def before_forward(self, runner: ModelRunner, slots: np.ndarray) -> None:
        if _victims(runner, slots, self.plan.step_error):
            raise InjectedFault("injected step fault")


def _victims(runner: ModelRunner, slots: torch.Tensor | np.ndarray, trigger: Trigger | None) -> list[int]:
    """Indices of `slots` holding a victim of `trigger` that is due."""
    if trigger is None:
        return []
    batch = runner.batch
    found = []
    for i, slot in enumerate(slots.tolist()):
        tokens = batch.tokens[slot]
        if (tokens and tokens[0] == trigger.marker_token
                and batch.num_computed[slot] - batch.num_prompt[slot] >= trigger.after):
            found.append(i)
    return found
