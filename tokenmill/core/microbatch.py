"""How many tokens one pipeline micro-batch takes: an even share of the work, by tokens.

With `pp` micro-batches in flight (or `pp_microbatches`), each stage is busy only if the batches
are about equally large. A new batch's budget is the work in sight (tokens of running rows that
can be scheduled now, prompts waiting, and the batches still in flight, which come back as work
of their own) divided by the number of micro-batches, capped by `max_num_batched_tokens`. So a long prompt is
chunked across micro-batches (its next chunk may go while the previous one is in flight), and
a decode-only load splits into batches of about equal size. Balancing counts tokens, not
requests: a batch of one 500-token chunk weighs as much as 500 decodes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tokenmill.core.request import Request
from tokenmill.core.running_table import RunningTable


def pipeline_token_budget(table: RunningTable, waiting: Iterable[Request], in_flight_tokens: int,
                          num_batches: int, max_tokens: int, placeholder_ok: np.ndarray | None = None) -> int:
    """The next micro-batch's token budget, in [1, max_tokens]. `placeholder_ok` (by slot): rows
    that may run on a token still in flight (pipeline device tokens)."""
    slots = table.order
    ready = table.num_pending[slots] == 0  # a row whose sampled token is in flight has nothing to run
    reach = table.num_tokens[slots]
    if placeholder_ok is not None:  # ... unless that token reaches the first stage on the devices
        ok = placeholder_ok[slots]
        ready |= ok
        reach = reach + table.num_pending[slots] * ok
    running = int(np.maximum(reach - table.num_computed[slots], 0)[ready].sum())
    cap = num_batches * max_tokens  # past this every batch is full anyway: stop counting
    queued = 0
    for request in waiting:
        if running + queued + in_flight_tokens >= cap:
            break
        if request.token_ids is not None:
            queued += len(request.token_ids)
    total = running + queued + in_flight_tokens
    return max(1, min(max_tokens, -(-total // num_batches)))
