"""An eager step's greedy argmax across the TP ranks' vocab columns, as a decode graph's greedy
step-end graph takes it (`GreedyTail`, `ParallelLMHead.argmax`): no logits all-gather (a prefill
chunk with ~1000 sampling rows gathers 1000 x 128k float32 logits, then screens and argmaxes them
whole), three numbers a row instead. Every TP rank of the last stage takes the same branch: the
conditions are the sampling plan's and the step's, the same on every rank.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from tokenmill.protocol import RowFailure

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


def applies(runner: ModelRunner, sample_rows, sample_drafts, awaits_mask: bool) -> bool:
    """TP with a vocab row on every rank, every request plain greedy without logprobs, no drafts to
    verify, no grammar masks, no speculation and no test hooks on the sampling path, and rows that
    sample (`TOKENMILL_TP_SHARDED_ARGMAX=0`: never)."""
    head = getattr(runner.model, "logits_head", None)
    plan = runner.sampling.plan
    return (head is not None and head.shards_argmax() and plan.plain_greedy and plan.logprobs is None
            and not plan.structured and not awaits_mask and runner.faults is None and runner.speculator is None
            and sample_drafts is None and len(sample_rows) > 0
            and os.environ.get("TOKENMILL_TP_SHARDED_ARGMAX", "1") != "0")


def run(runner: ModelRunner, hidden: torch.Tensor, sample_slots: torch.Tensor) -> torch.Tensor:
    """The sampling rows' packed result, as the greedy tail's (the token, or -NON_FINITE_LOGITS for a
    row whose logits are not finite), with their next inputs set on the device."""
    ids, bad = runner.model.logits_head.argmax(runner.model.compute_logits(hidden, gather=False))
    sampled = torch.where(bad, 0, ids)  # a failed row still gets a valid next input
    runner.batch.next_token_dev[sample_slots] = sampled
    return torch.where(bad, -int(RowFailure.NON_FINITE_LOGITS), sampled)
