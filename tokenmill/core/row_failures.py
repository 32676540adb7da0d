"""Rows of a step that failed alone in the worker (non-finite logits, a sampling error): their
requests end with FinishReason.ERROR; every other row of the step stands.

Runs after `step_update.apply_step`, only when the worker reported failed rows (rare), so the
common step pays nothing. apply_step has already appended the failed row's (meaningless)
token; the request is finishing, so that token is never shown: its row leaves the packed
one-token columns and any other news, and one output carrying the failure replaces them.
"""

from __future__ import annotations

import logging

import numpy as np

from tokenmill.core.request import Request
from tokenmill.core.step_update import StepResult
from tokenmill.protocol import (EngineCoreOutput, EngineCoreOutputs, FinishReason, ModelRunnerOutput,
                                SchedulerOutput)

logger = logging.getLogger(__name__)
_I32 = np.dtype("<i4")


def fail_rows(requests: dict[int, Request], so: SchedulerOutput, out: ModelRunnerOutput,
              result: StepResult) -> StepResult:
    """`result` with each failed row's request finished as ERROR (requests that already left,
    aborted while the step was in flight, are skipped)."""
    failed: dict[int, EngineCoreOutput] = {}
    for row, why in out.row_failures():
        handle = int(so.batch_handles[row])
        request = requests.get(handle)
        if request is None or handle in failed:
            continue
        logger.warning("request %d failed alone in step %d: %s", handle, so.step_id, why.name)
        request.finish_reason = FinishReason.ERROR
        request.stop_token_id = None
        failed[handle] = EngineCoreOutput(handle, [], FinishReason.ERROR, failure=why,
                                          num_cached_tokens=max(request.num_cached_tokens, 0))
    if not failed:
        return result
    outputs = result.outputs
    handles, tokens = outputs.one_token_rows()
    keep = ~np.isin(handles, np.fromiter(failed, np.int64, len(failed)))
    news = [o for o in outputs.outputs if o.handle not in failed] + list(failed.values())
    finished = [r for r in result.finished if r.handle not in failed]
    finished += [requests[h] for h in failed]
    return StepResult(EngineCoreOutputs(outputs=news, timestamp=outputs.timestamp,
                                        token_handles=handles[keep].astype(_I32).tobytes(),
                                        token_ids=tokens[keep].astype(_I32).tobytes()), finished)
