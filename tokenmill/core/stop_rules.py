"""Which sampled tokens finish their request, for many rows of the RunningTable at once.

The rule is `Request.finish_reason_for`: a stop id (EOS unless ignore_eos, or one of the
request's stop_token_ids) past min_tokens stops it; reaching max output tokens ends it;
a stop wins over the length limit. The rows are screened with numpy (a token equal to a
common EOS id, a length at the limit); only those candidates, and the few rows with other
stop ids (`custom_stops`), are looked at one by one.
"""

from __future__ import annotations

import numpy as np

from tokenmill.core.running_table import RunningTable
from tokenmill.protocol import FinishReason


def finishing_rows(table: RunningTable, slots: np.ndarray, tokens: np.ndarray,
                   eos_ids: np.ndarray) -> list[tuple[int, FinishReason]]:
    """(row, reason) for each row (an index into `slots`, ascending) whose new token, already
    appended, finishes its request."""
    reasons: dict[int, FinishReason] = {}
    for row in (table.num_tokens[slots] >= table.token_limit[slots]).nonzero()[0].tolist():
        reasons[row] = FinishReason.LENGTH
    candidates: list[int] = []
    for eos in eos_ids.tolist():
        candidates.extend(i for i in (tokens == eos).nonzero()[0].tolist() if table.stops_on_eos[slots[i]])
    if table.num_custom_stops:
        for i in table.custom_stops[slots].nonzero()[0].tolist():
            request = table.requests[slots[i]]
            assert request is not None
            if int(tokens[i]) in request.stop_ids:
                candidates.append(i)
    for i in candidates:
        slot = slots[i]
        if table.num_tokens[slot] - table.num_prompt[slot] > table.min_tokens[slot]:
            reasons[i] = FinishReason.STOP
    return sorted(reasons.items())
