"""One request's row failing must not fail the step: non-finite logits, or sampling that raises.

Around the sampler call, per step:
- `screen_logits`: rows whose logits hold a NaN or an infinity are found on the device (one
  reduction, no host sync) and zeroed, so that sampling them stays well defined;
- `sample_rows`: the sampler over the whole batch; if it raises, each row is tried alone to
  find the rows that fail, and the batch is sampled again with those rows on the scratch slot's
  neutral parameters (a failure then is the step's: it propagates);
- `mark_failed`: the read-back copy of the sampled ids carries a negative sentinel
  (-RowFailure) on failed rows, while the device keeps a valid id as their next input (a
  speculative step: `mark_failed_counts` puts it in the row's emitted count; sampling errors
  are isolated in plain steps only: in a verification step they fail the step);
- `split_failures` (host, when the reply is built): the sentinels become the reply's
  `failed_rows` / `failures`, and a harmless token id in `sampled`.
The engine core then ends those requests with FinishReason.ERROR (core/row_failures.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from tokenmill.layers.sampling import SamplerOutput
from tokenmill.protocol import RowFailure

logger = logging.getLogger(__name__)

_I32 = np.dtype("<i4")
SampleFn = Callable[..., SamplerOutput]  # (logits, slots, *, record=True) -> SamplerOutput


def screen_logits(logits: torch.Tensor) -> torch.Tensor:
    """bool [N] on the device: rows with a NaN or infinite logit (or finite ones summing past
    float32's range). Those rows are zeroed in place."""
    bad = ~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
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


def mark_failed_counts(num_emitted: torch.Tensor, non_finite: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """A speculative step's emitted counts [S] for the read-back: -RowFailure on rows with a
    non-finite position (`non_finite` [P], `row_of` [P]: each position's row)."""
    bad = torch.zeros_like(num_emitted).index_add_(0, row_of, non_finite.to(num_emitted.dtype)) > 0
    return torch.where(bad, -int(RowFailure.NON_FINITE_LOGITS), num_emitted)


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
