"""One request's row failing must not fail the step: non-finite logits, or sampling that raises.

Around the sampler call, per step:
- `screen_logits`: rows whose logits hold a NaN or an infinity are found on the device (one
  reduction, no host sync) and zeroed, so that sampling them stays well defined;
- `sample_rows` (a plain step): the sampler over the whole batch; if it raises, each row is
  tried alone to find the rows that fail, and the batch is sampled again with those rows on the
  scratch slot's neutral parameters (a failure then is the step's: it propagates);
- `verify_rows` (a speculative verification step): the same, one request's 1 + k positions
  being a row: the failing rows are found alone, the others verified again together, and the
  failed ones emit one placeholder token, so the device state stays consistent for them too;
- `mark_failed`: the read-back copy of the sampled ids carries a negative sentinel
  (-RowFailure) on failed rows, while the device keeps a valid id as their next input (a
  speculative step: `mark_failed_counts` puts it in the row's emitted count);
- `split_failures` (host, when the reply is built): the sentinels become the reply's
  `failed_rows` / `failures`, and a harmless token id in `sampled`.
The engine core then ends those requests with FinishReason.ERROR (core/row_failures.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from tokenmill.layers.sampling import SamplerOutput
from tokenmill.protocol import RowFailure

logger = logging.getLogger(__name__)

_I32 = np.dtype("<i4")
SampleFn = Callable[..., SamplerOutput]  # (logits, slots, *, record=True) -> SamplerOutput
PLACEHOLDER_TOKEN = 0  # what a failed verification row emits (its request ends with an error)


@dataclass(frozen=True)
class VerifyBatch:
    """The sampling rows of a verification step: request r has 1 + drafts[r] positions, flat."""

    logits: torch.Tensor  # [P, V]
    position_slots: torch.Tensor  # int64 [P]: each position's slot
    offsets: torch.Tensor  # int64 [P]: each position's output offset in its request (0..k_r)
    slots: torch.Tensor  # int64 [R]
    num_drafts: torch.Tensor  # int64 [R]
    drafts: np.ndarray  # int64 [R]: num_drafts on the host
    max_drafts: int  # K

    def rows(self, rows: list[int]) -> VerifyBatch:
        """The batch of these rows only (copies)."""
        per_row = self.drafts + 1
        starts = np.cumsum(per_row) - per_row
        positions = np.concatenate([np.arange(starts[r], starts[r] + per_row[r]) for r in rows])
        at = torch.as_tensor(positions, device=self.logits.device)
        index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=self.logits.device)
        return VerifyBatch(self.logits.index_select(0, at), self.position_slots.index_select(0, at),
                           self.offsets.index_select(0, at), self.slots.index_select(0, index),
                           self.num_drafts.index_select(0, index), self.drafts[rows], self.max_drafts)


# (emitted int64 [R, K + 1], num_emitted int64 [R], per-row logprob tensors or None)
Verified = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]
VerifyFn = Callable[[VerifyBatch], Verified]  # must change no state: it may run more than once


def screen_logits(logits: torch.Tensor) -> torch.Tensor:
    """bool [N] on the device: rows with a NaN or infinite logit (or finite ones summing past
    float32's range). Those rows are zeroed in place."""
    bad = ~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
    # On the host the check is free, and a healthy step (almost every one) skips a pass over the
    # logits (~1.3% of a CPU worker at 64 rows x 49k vocab); on a GPU it would sync: always fill.
    if logits.device.type != "cpu" or bool(bad.any()):
        logits.masked_fill_(bad[:, None], 0.0)
    return bad


def sample_rows(sample: SampleFn, logits: torch.Tensor, slots: torch.Tensor,
                scratch_slot: int) -> tuple[SamplerOutput, list[int]]:
    """The sampler's output for every row, and the rows (indices) whose sampling raised alone."""
    try:
        return sample(logits, slots), []
    except Exception:  # noqa: BLE001 - find the row(s) at fault; the rest of the batch goes on
        logger.exception("sampling a step of %d rows failed; retrying row by row", len(slots))
    failed = []
    for row in range(len(slots)):
        try:
            sample(logits[row:row + 1], slots[row:row + 1], record=False)
        except Exception:  # noqa: BLE001 - this row's failure is reported to its request
            logger.exception("sampling row %d (slot %d) failed", row, int(slots[row]))
            failed.append(row)
    if failed:
        index = torch.tensor(failed, dtype=torch.int64, device=slots.device)
        slots = slots.index_fill(0, index, scratch_slot)
        logits.index_fill_(0, index, 0.0)
    return sample(logits, slots), failed


def verify_rows(verify: VerifyFn, batch: VerifyBatch) -> tuple[Verified, list[int]]:
    """`verify(batch)`, and the rows (indices) whose verification raised alone: they emit
    PLACEHOLDER_TOKEN once (num_emitted 1), zero logprobs; the rest are verified together."""
    try:
        return verify(batch), []
    except Exception:  # noqa: BLE001 - find the row(s) at fault; the rest of the batch goes on
        logger.exception("verifying a step of %d rows failed; retrying row by row", len(batch.drafts))
    failed = []
    for row in range(len(batch.drafts)):
        try:
            verify(batch.rows([row]))
        except Exception:  # noqa: BLE001 - this row's failure is reported to its request
            logger.exception("verifying row %d (slot %d) failed", row, int(batch.slots[row]))
            failed.append(row)
    if not failed:
        return verify(batch), []  # a failure of the whole step: it propagates
    healthy = [row for row in range(len(batch.drafts)) if row not in failed]
    num_rows, device = len(batch.drafts), batch.slots.device
    emitted = torch.full((num_rows, batch.max_drafts + 1), -1, dtype=torch.int64, device=device)
    emitted[:, 0] = PLACEHOLDER_TOKEN
    num_emitted = torch.ones(num_rows, dtype=torch.int64, device=device)
    logprobs = None
    if healthy:
        part_emitted, part_num, part_logprobs = verify(batch.rows(healthy))
        index = torch.as_tensor(healthy, dtype=torch.int64, device=device)
        emitted.index_copy_(0, index, part_emitted)
        num_emitted.index_copy_(0, index, part_num)
        if part_logprobs is not None:
            logprobs = [t.new_zeros((num_rows, *t.shape[1:])).index_copy_(0, index, t) for t in part_logprobs]
    return (emitted, num_emitted, logprobs), failed


def mark_failed(out: SamplerOutput, non_finite: torch.Tensor | None, failed: list[int]) -> SamplerOutput:
    """`out` for the read-back: failed rows' ids replaced by -RowFailure."""
    if non_finite is None and not failed:
        return out
    sampled = out.sampled
    if non_finite is not None:
        sampled = torch.where(non_finite, -int(RowFailure.NON_FINITE_LOGITS), sampled)
    if failed:
        index = torch.tensor(failed, dtype=torch.int64, device=sampled.device)
        sampled = sampled.index_fill(0, index, -int(RowFailure.SAMPLING_ERROR))
    return replace(out, sampled=sampled)


def mark_failed_counts(num_emitted: torch.Tensor, non_finite: torch.Tensor, row_of: torch.Tensor,
                       failed: list[int] | None = None) -> torch.Tensor:
    """A speculative step's emitted counts [S] for the read-back: -RowFailure on rows with a
    non-finite position (`non_finite` [P], `row_of` [P]: each position's row) and on the rows
    `verify_rows` found failing (`failed`)."""
    bad = torch.zeros_like(num_emitted).index_add_(0, row_of, non_finite.to(num_emitted.dtype)) > 0
    marked = torch.where(bad, -int(RowFailure.NON_FINITE_LOGITS), num_emitted)
    if failed:
        index = torch.tensor(failed, dtype=torch.int64, device=marked.device)
        marked = marked.index_fill(0, index, -int(RowFailure.SAMPLING_ERROR))
    return marked


def split_failures(values: np.ndarray, rows: np.ndarray, healthy: int = 0) -> tuple[np.ndarray, bytes, bytes]:
    """Host side: `values` (one per sampling row: its token, or a speculative row's emitted count;
    sentinels included) with sentinels replaced by `healthy`, and the failed batch rows
    (`rows[i]` is sampling row i's batch row) and their RowFailure, as packed int32."""
    failed = np.flatnonzero(values < 0)
    if not len(failed):
        return values, b"", b""
    kinds = -values[failed]
    values = values.copy()
    values[failed] = healthy
    return values, rows[failed].astype(_I32).tobytes(), kinds.astype(_I32).tobytes()
