"""Applying a finished step's sampled tokens to the running requests (the scheduler's `update`).

Rows that take one token and whose request still holds the row's slot (the steady decode)
are handled together with numpy: append the token, screen the stop conditions, report it in
the packed columns of EngineCoreOutputs. Python only visits rows with news (a finish,
logprobs, a prefix-cache hit the front-end has not heard of) and unusual rows, the slow way:
zero or several tokens, or a request that left its slot while the step was in flight
(preempted, finished, aborted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenmill.core.request import Request
from tokenmill.core.running_table import RunningTable
from tokenmill.core.stop_rules import finishing_rows
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, Logprobs, SchedulerOutput
from tokenmill.protocol import ModelRunnerOutput

_I32 = np.dtype("<i4")


@dataclass
class StepResult:
    outputs: EngineCoreOutputs
    finished: list[Request]  # in row order; the caller ends them


OnVerified = Callable[[int, int, int], None]  # (slot or -1, drafts verified, drafts accepted)


def apply_step(table: RunningTable, requests: dict[int, Request], eos_ids: np.ndarray,
               so: SchedulerOutput, out: ModelRunnerOutput, on_verified: OnVerified | None = None) -> StepResult:
    """Append `out`'s tokens to the requests of `so`'s rows. Rows that verified drafts
    (`so.num_drafts`) give back the computed tokens and in-flight room of the rejected ones."""
    slots, handles = so.row_slots, so.batch_handles
    drafts = getattr(so, "num_drafts", None)
    tokens = out.sampled_tokens()
    counts = first = None  # None: every row sampled one token
    one_token = None  # None: every row takes the fast way
    if out.count_rows:
        counts = out.row_counts(len(slots))
        first = np.cumsum(counts) - counts  # each row's first token
        one_token = counts == 1
    if so.table_version != table.version:  # a slot may have changed hands since the step was scheduled
        on_slot = table.handle[slots] == handles
        one_token = on_slot if one_token is None else one_token & on_slot
    if drafts is not None:  # rows that verified drafts go the slow way
        one_token = (drafts == 0) if one_token is None else one_token & (drafts == 0)
    if one_token is None:
        rows, row_slots, row_tokens = None, slots, tokens
    else:
        rows = one_token.nonzero()[0]
        row_slots = slots[rows]
        row_tokens = tokens[rows] if first is None else tokens[first[rows]]

    table.num_pending[row_slots] -= 1
    at = table.num_tokens[row_slots]
    table.tokens[row_slots, at] = row_tokens
    table.num_tokens[row_slots] = at + 1

    row_of: Callable[[int], int] = (lambda i: i) if rows is None else (lambda i: int(rows[i]))  # -> batch row
    news: dict[int, EngineCoreOutput] = {}  # by batch row
    finished: dict[int, Request] = {}
    ending = finishing_rows(table, row_slots, row_tokens, eos_ids)
    for i, reason in ending:
        request = table.requests[row_slots[i]]
        assert request is not None
        _set_finished(request, reason, int(row_tokens[i]))
        finished[row_of(i)] = request
    with_news = _fast_rows_with_news(table, row_slots, [i for i, _ in ending], out, row_of)
    for i in with_news:
        row = row_of(i)
        request = table.requests[row_slots[i]]
        assert request is not None
        news[row] = _output(table, request, [int(row_tokens[i])], _at(out.logprobs, row),
                            _at(out.prompt_logprobs, row))

    if one_token is not None:
        for row in (~one_token).nonzero()[0].tolist():
            count = 1 if counts is None else int(counts[row])
            start = row if first is None else int(first[row])
            _apply_row(table, requests, row, int(handles[row]), tokens[start:start + count].tolist(),
                       out, news, finished, 0 if drafts is None else int(drafts[row]), on_verified)
    if not with_news and rows is None:  # the steady decode: pass the columns on as they are
        token_handles, token_ids = handles.astype(_I32, copy=False).tobytes(), out.sampled
    else:
        plain = np.ones(len(row_slots), bool)
        plain[with_news] = False
        token_handles = (handles if rows is None else handles[rows])[plain].astype(_I32, copy=False).tobytes()
        token_ids = row_tokens[plain].astype(_I32, copy=False).tobytes()
    outputs = EngineCoreOutputs(outputs=[news[row] for row in sorted(news)],
                                token_handles=token_handles, token_ids=token_ids)
    return StepResult(outputs, [finished[row] for row in sorted(finished)])


def _fast_rows_with_news(table: RunningTable, row_slots: np.ndarray, ending: list[int], out: ModelRunnerOutput,
                         row_of: Callable[[int], int]) -> list[int]:
    """Fast-way rows (indices into `row_slots`) whose output needs more than the token itself:
    a finish, a prefix-cache hit to report, logprobs."""
    picked = set(ending)
    if table.num_cached_to_report:
        picked.update(table.cached_to_report[row_slots].nonzero()[0].tolist())
    for per_row in (out.logprobs, out.prompt_logprobs):
        if per_row:
            picked.update(i for i in range(len(row_slots)) if per_row[row_of(i)] is not None)
    return sorted(picked)


def _apply_row(table: RunningTable, requests: dict[int, Request], row: int, handle: int, sampled: list[int],
               out: ModelRunnerOutput, news: dict[int, EngineCoreOutput], finished: dict[int, Request],
               num_drafts: int = 0, on_verified: OnVerified | None = None) -> None:
    """One row the slow way (the reference semantics, kept for every unusual row). A row that
    verified `num_drafts` drafts sampled 1 + (accepted drafts) tokens: the step had reserved
    1 + num_drafts, and counted every draft as computed."""
    prompt_lp = _at(out.prompt_logprobs, row)
    request = requests.get(handle)
    if not sampled:  # a prefill chunk short of the prompt's end
        if prompt_lp is not None and request is not None:
            news[row] = EngineCoreOutput(handle=handle, new_token_ids=[], prompt_logprobs=prompt_lp)
        return
    if request is None:
        return  # finished or aborted while this step was in flight
    rejected = num_drafts - (len(sampled) - 1)
    if request.slot >= 0:
        table.num_pending[request.slot] -= 1 + num_drafts
        table.num_computed[request.slot] -= rejected
        table.due_step[request.slot] = 0  # not a plain one-token step: the scheduler must look again
    else:
        request.num_pending -= 1 + num_drafts  # preempted while this step was in flight
    if num_drafts and on_verified is not None:
        on_verified(request.slot, num_drafts, num_drafts - rejected)
    new_tokens = []
    for token in sampled:
        new_tokens.append(token)
        if _append(table, request, token):
            finished[row] = request
            break
    news[row] = _output(table, request, new_tokens, _at(out.logprobs, row), prompt_lp)


def _append(table: RunningTable, request: Request, token: int) -> bool:
    """Append one token to a request, on the table or off it; True when it finishes the request."""
    slot = request.slot
    if slot >= 0:
        at = int(table.num_tokens[slot])
        table.tokens[slot, at] = token
        table.num_tokens[slot] = at + 1
        num_output = at + 1 - request.num_prompt_tokens
    else:
        assert request.token_ids is not None
        request.token_ids = np.append(request.token_ids, np.int32(token))
        num_output = len(request.token_ids) - request.num_prompt_tokens
    reason = request.finish_reason_for(token, num_output)
    if reason is None:
        return False
    _set_finished(request, reason, token)
    return True


def _set_finished(request: Request, reason: FinishReason, token: int) -> None:
    request.finish_reason = reason
    if reason == FinishReason.STOP and token in request.stop_token_ids:
        request.stop_token_id = token


def _output(table: RunningTable, request: Request, new_tokens: list[int], logprobs: Logprobs | None,
            prompt_logprobs: Logprobs | None) -> EngineCoreOutput:
    """A row's news in full; it carries the prefix-cache hit, so the front-end has now heard it."""
    request.cached_tokens_reported = True
    if request.slot >= 0:
        table.reported_cached_tokens(request.slot)
    return EngineCoreOutput(
        handle=request.handle, new_token_ids=new_tokens, finish_reason=request.finish_reason,
        stop_token_id=request.stop_token_id, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        num_cached_tokens=max(request.num_cached_tokens, 0))


def _at(per_row: list[Logprobs | None], row: int) -> Logprobs | None:
    return per_row[row] if per_row else None
