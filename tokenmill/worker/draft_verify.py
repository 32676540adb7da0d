"""Speculative decoding's verification step on the target model's logits.

Every position of the sampling rows is sampled (logits [sum(1 + drafts), V]); each row keeps its
drafts up to the first that differs from the target's own sample, plus that sample (the bonus
token); then the rows' next input, computed count and history are set from what they emitted.
With a draft model's distributions, rejection sampling replaces the exact-match rule (greedy rows
fall out of it: one-hot p and q). Rows that fail alone (non-finite logits, sampling raising) fail
only their request (`row_faults`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded
from tokenmill.layers.sampling.spec_verify import rejection_sample, verify_drafts
from tokenmill.layers.sampling.token_bitmask import apply_bitmask_by_row
from tokenmill.worker import row_faults
from tokenmill.worker.persistent_batch import to_device

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.pending_step import PendingStep


def verify_step(runner: ModelRunner, logits: torch.Tensor, slots: np.ndarray, slots_d: torch.Tensor,
                drafts: np.ndarray, seq_lens: torch.Tensor, step: PendingStep, masked: tuple | None = None) -> None:
    """Verify the step's drafts, update the rows' state and start the step's read-back."""
    per_row = drafts + 1
    offsets = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    row_of = np.repeat(np.arange(len(slots)), per_row)
    host = np.concatenate([np.repeat(slots, per_row), offsets, row_of, drafts])
    packed = to_device(host, runner.device)
    n = len(offsets)
    slots_rep, offsets_d, row_of_d, drafts_d = packed[:n], packed[n:2 * n], packed[2 * n:3 * n], packed[3 * n:]
    non_finite = runner._screen(logits, slots_rep)  # per position
    if masked is not None:  # constrained rows' positions, after the screen
        apply_bitmask_by_row(logits, *masked)
    speculator = runner.speculator
    batch = row_faults.VerifyBatch(logits, slots_rep, offsets_d, slots_d, drafts_d, drafts, speculator.k)
    (emitted, num_emitted, logprobs), failed = row_faults.verify_rows(lambda b: verify_rows(runner, b), batch)
    runner.sampler.advance(slots_d, num_emitted, emitted)
    runner.batch.next_token_dev[slots_d] = emitted.gather(1, (num_emitted - 1)[:, None]).squeeze(1)
    runner.batch.num_computed_dev[slots_d] = seq_lens - drafts_d - 1 + num_emitted
    if speculator.recording:
        speculator.record(slots_d, emitted, num_emitted)
    num_emitted = row_faults.mark_failed_counts(num_emitted, non_finite, row_of_d, failed)  # read-back copy
    step.start_speculative_readback(emitted, num_emitted, runner.readback, slots, drafts, logprobs)


def verify_rows(runner: ModelRunner, b: row_faults.VerifyBatch) -> row_faults.Verified:
    """`verify_step`'s tokens for the rows of `b`, changing no state (row_faults may retry rows)."""
    k = b.max_drafts
    speculator, draft, sampler = runner.speculator, runner.draft, runner.sampler
    out = runner._sample(b.logits, b.position_slots, offsets=b.offsets, record=False)
    if draft is not None and draft.probs is not None and runner.sampling.plan.any_random:
        target = sampler.probs(b.logits, b.position_slots, b.offsets)
        draft_rows, draft_cols = flat_rows(b.num_drafts - 1, int(b.drafts.sum()))  # one row per draft
        q = draft.probs[b.slots[draft_rows], draft_cols]
        emitted, num_emitted = rejection_sample(sampler, b.slots, target, q, speculator.drafts[b.slots, :k],
                                                b.num_drafts)
    else:
        grid = flat_to_padded(out.sampled, b.num_drafts, k, -1)
        emitted, num_emitted = verify_drafts(grid, speculator.drafts[b.slots, :k], b.num_drafts)
    logprobs = None
    if out.logprobs is not None:  # rows that want logprobs have no drafts: their one position
        first = to_device(np.cumsum(b.drafts + 1) - b.drafts - 1, runner.device)
        lp = out.logprobs
        logprobs = [t.index_select(0, first) for t in (lp.sampled_logprobs, lp.sampled_ranks,
                                                      lp.topk_token_ids, lp.topk_logprobs)]
    return emitted, num_emitted, logprobs
