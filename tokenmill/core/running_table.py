"""The running requests' per-step state as numpy columns, one row ("slot") per request.

A steady decode step (every row takes one more token, no new block) is then a handful of
numpy operations over all rows in the scheduler and in the update, instead of a Python loop.
Slots are stable while a request runs and reused after it leaves; `order` lists the running
slots in scheduling priority (arrival into the running set; the last one is preempted first).

Invariants for a running slot s (request r = requests[s]):
- tokens[s, :num_tokens[s]] are r's token ids (prompt, then outputs received so far);
- num_computed[s] <= num_tokens[s] + num_pending[s] (scheduled placeholders included), and
  num_computed[s] <= block_capacity[s] (the tokens r's blocks can hold);
- num_pending[s]: the most tokens the steps in flight can still add to r (one per plain step,
  1 + k for a step verifying k drafts); num_computed counts a step's drafts as computed until
  its update takes back the rejected ones (so it is an upper bound while drafts are in flight);
- next_full_block_at[s]: once this many known tokens are computed, r's next block is full
  and must be registered in the prefix cache (NEVER when caching is off).
"""

from __future__ import annotations

import numpy as np

from tokenmill.core.request import Request

NEVER = np.iinfo(np.int64).max // 2


class RunningTable:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        i64 = lambda: np.zeros(max_rows, np.int64)  # noqa: E731
        self.handle = np.full(max_rows, -1, np.int64)  # -1: a free slot
        self.num_tokens = i64()
        self.num_computed = i64()
        self.num_pending = i64()
        self.num_prompt = i64()
        self.token_limit = i64()  # prompt + max output tokens: nothing is scheduled past it
        self.min_tokens = i64()
        self.block_capacity = i64()
        self.next_full_block_at = i64()
        self.due_step = i64()  # the scheduler must look at the row from this step on (see Scheduler._plan)
        self.stops_on_eos = np.zeros(max_rows, bool)
        self.custom_stops = np.zeros(max_rows, bool)  # stop ids beyond the common EOS ids: checked row by row
        self.cached_to_report = np.zeros(max_rows, bool)  # its first output must carry num_cached_tokens
        # Speculative decoding (see spec_policy.py): may the row get drafts, its decayed
        # acceptance counts, and the last step at whose end the workers proposed drafts for it.
        self.spec_ok = np.zeros(max_rows, bool)
        self.spec_hits = np.zeros(max_rows, np.float64)
        self.spec_trials = np.zeros(max_rows, np.float64)
        self.proposed_at = np.full(max_rows, -1, np.int64)
        self.tokens = np.zeros((max_rows, 0), np.int32)
        self.requests: list[Request | None] = [None] * max_rows
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self._order = np.zeros(max_rows, np.int64)
        self.num_running = 0
        self.version = 0  # bumped whenever a row is added or removed (slots change hands)
        self.num_custom_stops = 0  # running rows with custom_stops set
        self.num_cached_to_report = 0  # running rows with cached_to_report set
        self.structured = np.zeros(max_rows, bool)  # the row samples under a grammar (structured outputs)
        self.num_structured = 0

    @property
    def order(self) -> np.ndarray:
        """Running slots in priority order (a view: copy it before adding or removing rows)."""
        return self._order[:self.num_running]

    def add(self, request: Request, num_computed: int, block_capacity: int, next_full_block_at: int,
            stops_on_eos: bool, custom_stops: bool, spec_ok: bool = False) -> int:
        """Move a request's state in (it goes last in `order`); returns its slot."""
        tokens = request.token_ids
        assert tokens is not None and request.num_pending == 0 and self.num_running < self.max_rows
        slot = self._free_slots.pop()
        limit = request.num_prompt_tokens + max(request.max_output_tokens, 0)
        self._fit_width(max(limit, len(tokens)))
        self.tokens[slot, :len(tokens)] = tokens
        self.handle[slot] = request.handle
        self.num_tokens[slot] = len(tokens)
        self.num_computed[slot] = num_computed
        self.num_pending[slot] = 0
        self.num_prompt[slot] = request.num_prompt_tokens
        self.token_limit[slot] = limit
        self.min_tokens[slot] = request.params.min_tokens
        self.block_capacity[slot] = block_capacity
        self.next_full_block_at[slot] = next_full_block_at
        self.due_step[slot] = 0
        self.spec_ok[slot] = spec_ok
        self.spec_hits[slot] = self.spec_trials[slot] = 0.0
        self.proposed_at[slot] = -1
        self.stops_on_eos[slot] = stops_on_eos
        self.custom_stops[slot] = custom_stops
        self.num_custom_stops += custom_stops
        report = request.num_cached_tokens > 0 and not request.cached_tokens_reported
        self.cached_to_report[slot] = report
        self.num_cached_to_report += report
        constrained = request.grammar is not None
        self.structured[slot] = constrained
        self.num_structured += constrained
        self.requests[slot] = request
        self._order[self.num_running] = slot
        self.num_running += 1
        self.version += 1
        request.token_ids = None
        request.slot = slot
        return slot

    def move_out(self, slot: int) -> None:
        """Give a request its state back (a preemption) and free its slot."""
        request = self.requests[slot]
        assert request is not None
        request.token_ids = self.token_row(slot).copy()
        request.num_pending = int(self.num_pending[slot])
        self.remove([slot])

    def remove(self, slots: list[int]) -> None:
        """Free these slots (finished or preempted requests), keeping `order` for the rest."""
        if len(slots) == 1 and self.num_running and self._order[self.num_running - 1] == slots[0]:
            self.num_running -= 1  # the last one (a preemption): nothing to compact
        else:
            order = self.order
            keep = order[~np.isin(order, slots)]
            self._order[:len(keep)] = keep
            self.num_running = len(keep)
        for slot in slots:
            request = self.requests[slot]
            if request is not None:
                request.slot = -1
            self.requests[slot] = None
            self.handle[slot] = -1
            self.num_custom_stops -= int(self.custom_stops[slot])
            self.custom_stops[slot] = False
            self.num_structured -= int(self.structured[slot])
            self.structured[slot] = False
            self.reported_cached_tokens(slot)
            self._free_slots.append(slot)
        self.version += 1

    def reported_cached_tokens(self, slot: int) -> None:
        """The front-end has heard this row's prefix-cache hit."""
        if self.cached_to_report[slot]:
            self.cached_to_report[slot] = False
            self.num_cached_to_report -= 1

    def token_row(self, slot: int) -> np.ndarray:
        """The request's token ids (a view)."""
        return self.tokens[slot, :self.num_tokens[slot]]

    def _fit_width(self, width: int) -> None:
        if width > self.tokens.shape[1]:
            grown = np.zeros((self.max_rows, max(width, 2 * self.tokens.shape[1])), np.int32)
            grown[:, :self.tokens.shape[1]] = self.tokens
            self.tokens = grown
