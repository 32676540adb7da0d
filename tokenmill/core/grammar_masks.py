"""The engine core's structured outputs: grammars compiled off the loop, one matcher per request,
advanced as tokens come back, and each step's token bitmask.

Which token a mask is for: a step's mask must follow every token sampled before it. With async
scheduling step N+1 is launched while step N runs, before N's tokens are known, so the mask of
N+1 cannot be made when N+1 is scheduled. It is made just in time instead: the worker runs N+1's
forward pass, sends N's tokens and waits for the mask; the core applies N's tokens (advancing the
matchers), fills N+1's mask on XGrammar's threads and sends it through the ring. The mask's work
overlaps N+1's forward pass; the device waits only if it takes longer (the step trace says).
`EngineCore` sends a step's mask once it is the oldest step in flight, and submits nothing after a
step whose mask is still owed, so the mask is always the next message the worker reads.

Speculative decoding: a constrained row verifying k drafts samples k + 1 positions, and the token
at position j must follow the grammar state after the row's known tokens and its first j drafts.
The drafts are proposed on the device at the end of step N, for N + 1, and come back with N's
tokens (`ModelRunnerOutput.drafts`), in time for N + 1's mask. So the mask has an entry per draft
position: the matcher is advanced through the drafts one at a time, its mask filled at each
position, and rolled back once the row is done, so between steps it holds the accepted tokens
only. A draft the grammar forbids ends its row's entries: its position's mask excludes it, so the
target's token there differs from it and verification stops (the draft is cut there, without a
second forward pass); later positions are never emitted and sample unmasked.

Requests wait here, outside the scheduler, while their grammar compiles (a cache hit for any
grammar the front-end checked: the texts are the same).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.protocol import GrammarBitmask, ModelRunnerOutput, SchedulerOutput, pack_ids
from tokenmill.structured_output.backend import GrammarBackend, bitmask_words
from tokenmill.structured_output.compiles import GrammarCompiles
from tokenmill.structured_output.grammar_spec import grammar_spec

logger = logging.getLogger(__name__)


class RequestGrammar:
    """A request's matcher, how many of its output tokens the matcher has taken, and the drafts
    proposed for its next step (speculative decoding) with the step that proposed them."""

    __slots__ = ("matcher", "num_accepted", "drafts", "drafts_step")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.drafts: list[int] = []
        self.drafts_step = -1


class GrammarMasks:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.compiles = GrammarCompiles(self._make_backend, config.structured.compile_timeout_s)
        self.compiling: dict[int, tuple[Request, Future]] = {}
        self.words = bitmask_words(config.model.arch.vocab_size)
        self._buffer = np.zeros((0, self.words), np.int32)
        # Figures for telemetry: masks made, rows in them, seconds spent.
        self.num_masks = 0
        self.num_mask_rows = 0
        self.mask_seconds = 0.0
        self.num_constrained = 0
        # Draft positions masked (speculative decoding), and drafts the grammar forbade there.
        self.num_draft_positions = 0
        self.num_drafts_forbidden = 0

    def _make_backend(self) -> GrammarBackend:
        path = self.config.structured.vocab_file
        if not path:
            raise RuntimeError("structured outputs: the front-end gave no vocabulary file")
        with open(path) as f:
            return GrammarBackend.from_json(f.read(), self.config.structured)

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        """Hold a constrained request until its grammar is compiled."""
        spec = grammar_spec(request.params.structured_outputs, self.config.structured.max_schema_bytes)
        self.compiling[request.handle] = (request, self.compiles.submit(spec))
        self.num_constrained += 1

    def abort(self, handles: list[int]) -> None:
        for handle in handles:
            self.compiling.pop(handle, None)

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (with their matcher), and those whose grammar failed."""
        ready, failed = [], []
        for handle, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[handle]
            try:
                compiled = future.result()
                request.grammar = RequestGrammar(self.compiles.backend().result().matcher(compiled))
                ready.append(request)
            except Exception as exc:  # noqa: BLE001 - the front-end checked it: this is rare
                logger.error("request %d: its grammar failed in the engine core: %s", handle, exc)
                failed.append((request, str(exc)))
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is compiled, at most `timeout_s` (an engine with nothing else to do)."""
        if self.compiling:
            wait([f for _, f in self.compiling.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ steps

    def advance(self, so: SchedulerOutput, requests: dict[int, Request], table) -> tuple[list[Request], list[Request]]:
        """Feed the matchers of `so`'s constrained rows the tokens its update appended. Returns the
        requests whose grammar is now complete (they end with `stop`) and those whose matcher refused
        a token (an engine bug: they end with an error)."""
        handles = getattr(so, "structured_handles", None)
        complete: list[Request] = []
        broken: list[Request] = []
        if handles is None:
            return complete, broken
        for handle in handles.tolist():
            request = requests.get(handle)
            if request is None or request.grammar is None:
                continue  # finished in this update, or aborted
            fed = _catch_up(request, table)
            if fed is None:
                broken.append(request)
            elif fed and request.grammar.matcher.is_terminated():
                complete.append(request)
        return complete, broken

    def take_drafts(self, so: SchedulerOutput, out: ModelRunnerOutput, requests: dict[int, Request]) -> None:
        """Keep the drafts step `so` proposed for its constrained rows (for the next step's mask)."""
        rows, drafts = out.draft_arrays()
        handles = so.batch_handles
        for row, row_drafts in zip(rows.tolist(), drafts.tolist()):
            request = requests.get(int(handles[row]))
            if request is not None and request.grammar is not None:
                request.grammar.drafts = row_drafts
                request.grammar.drafts_step = so.step_id

    def bitmask(self, so: SchedulerOutput, requests: dict[int, Request], table) -> GrammarBitmask:
        """The next-token masks of every constrained row of `so` (whose earlier steps are all
        applied), one per position it samples (see the module's docstring for draft positions).
        Each matcher first takes any token of its request it has not seen (one that came back while
        the request was preempted, say), so a mask always follows every known token."""
        start = time.perf_counter()
        num_drafts = getattr(so, "num_drafts", None)
        rows, matchers, drafts = [], [], []
        for row, handle in zip(so.structured_rows.tolist(), so.structured_handles.tolist()):
            request = requests.get(handle)
            if (request is None or request.grammar is None or _catch_up(request, table) is None
                    or request.grammar.matcher.is_terminated()):
                continue  # finished by the step before (the row's token is thrown away), or broken
            rows.append(row)
            matchers.append(request.grammar.matcher)
            k = 0 if num_drafts is None else int(num_drafts[row])
            if k:
                g = request.grammar
                assert g.drafts_step == so.step_id - 1 and len(g.drafts) >= k, (
                    f"request {handle}: step {so.step_id} verifies {k} drafts; the core has {len(g.drafts)} "
                    f"from step {g.drafts_step}")
                drafts.append(g.drafts[:k])
            else:
                drafts.append(())
        entries = len(rows) + sum(len(d) for d in drafts)
        if len(self._buffer) < entries:
            self._buffer = np.zeros((max(entries, 2 * len(self._buffer)), self.words), np.int32)
        entry_rows, positions = self._fill(rows, matchers, drafts, self._buffer)
        distinct, which = distinct_rows(self._buffer[:len(entry_rows)])
        mask = GrammarBitmask(so.step_id, pack_ids(entry_rows), pack_ids(which), self.words, distinct.tobytes(),
                              pack_ids(positions) if len(entry_rows) > len(rows) else b"")
        self.num_masks += 1
        self.num_mask_rows += len(entry_rows)
        self.mask_seconds += time.perf_counter() - start
        return mask

    def _fill(self, rows: list[int], matchers: list, drafts: list, out: np.ndarray) -> tuple[list[int], list[int]]:
        """Fill `out`'s first entries with each row's masks, position by position: the masks of
        every row at position j (batched), then each row that drafts further takes its j-th draft
        (a row whose draft the grammar forbids, or whose grammar it completes, stops there). The
        matchers end where they began. Returns each entry's (batch row, position)."""
        entry_rows: list[int] = []
        positions: list[int] = []
        if not rows:
            return entry_rows, positions
        backend = self.compiles.backend().result()
        if not any(drafts):  # the usual step: one position per row
            backend.fill_bitmask(matchers, out)
            return rows, [0] * len(rows)
        taken = [0] * len(rows)  # drafts each matcher took (rolled back at the end)
        active = list(range(len(rows)))
        depth = 0
        while active:
            first = len(entry_rows)
            backend.fill_bitmask_at([matchers[i] for i in active], out, list(range(first, first + len(active))))
            entry_rows += [rows[i] for i in active]
            positions += [depth] * len(active)
            further = [i for i in active if depth < len(drafts[i])]
            if not further:
                break
            ok = backend.accept_tokens([matchers[i] for i in further], [drafts[i][depth] for i in further])
            self.num_draft_positions += len(further)
            active = []
            for i, good in zip(further, ok):
                if not good:
                    self.num_drafts_forbidden += 1
                    continue
                taken[i] += 1
                if not matchers[i].is_terminated():  # (a draft that ends the grammar ends the request)
                    active.append(i)
            depth += 1
        back = [i for i, n in enumerate(taken) if n]
        backend.rollback([matchers[i] for i in back], [taken[i] for i in back])
        return entry_rows, positions

    def shutdown(self) -> None:
        self.compiles.shutdown()


def distinct_rows(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of `masks` [n, words], each row's index among them)."""
    if len(masks) <= 1:
        return masks, np.zeros(len(masks), np.int32)
    keys = np.ascontiguousarray(masks).view(np.dtype((np.void, masks.shape[1] * 4))).ravel()
    _, first, which = np.unique(keys, return_index=True, return_inverse=True)
    return masks[first], which.astype(np.int32)


def _catch_up(request: Request, table) -> int | None:
    """Feed the request's matcher the output tokens it has not taken (from its row of `table` while
    it runs, else from the request); how many it took, or None if it refused one."""
    g = request.grammar
    first = request.num_prompt_tokens + g.num_accepted
    if request.slot >= 0:
        new = table.tokens[request.slot, first:table.num_tokens[request.slot]]
    else:
        new = request.token_ids[first:]
    for token in new.tolist():
        if not g.matcher.accept_token(token):
            logger.error("request %d: token %d breaks its grammar", request.handle, token)
            return None
        g.num_accepted += 1
    return len(new)
