"""The grammar thread's work for one step: feed the matchers the tokens that came back, then fill
the next step's token bitmask.

The engine core hands each step's work over as a `GrammarJob` (built on the core's thread: which
matchers take which tokens, which rows the mask covers and their drafts) and `GrammarJobRunner.run`
does it on the grammar thread, where it owns every matcher: the core never touches a matcher while
a job is pending (core/grammar_masks.py). The library calls release the GIL, so the core's own
Python (applying the step, scheduling the next) runs meanwhile. Feeding is one token per matcher
per library call, split across a few threads once the batch is large (XGrammar's batched accept
runs on the caller's thread); filling uses XGrammar's own thread pool.

Every library call releases the GIL and takes it back, and taking it back waits for whichever
Python thread holds it (the core's loop, say): per-row calls add up (256 `is_terminated` calls
beside a busy thread took 139 ms at the default 5 ms switch interval on the development CPU).
So the job makes a few batched calls, and asks a matcher whether it terminated only after it
took a stop token (the only way it can), keeping the answer in `RequestGrammar.terminated`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tokenmill.protocol import GrammarBitmask, pack_ids


class RequestGrammar:
    """A request's matcher; how many of its output tokens the core has handed to the grammar thread
    (`num_fed`, the core's counter) and how many the matcher took (`num_accepted`, the thread's);
    whether it refused one (`broken`, the thread's); the drafts proposed for its next step
    (speculative decoding) with the step that proposed them (the core's)."""

    __slots__ = ("matcher", "num_fed", "num_accepted", "broken", "terminated", "drafts", "drafts_step")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_fed = 0
        self.num_accepted = 0
        self.broken = False
        self.terminated = False  # the matcher took a stop token that ended its grammar (the thread's)
        self.drafts: list[int] = []
        self.drafts_step = -1


@dataclass(slots=True)
class GrammarJob:
    """Tokens to feed (handle, grammar, tokens: in order, before any mask), then the mask of step
    `mask_step` (None: none) for batch rows `rows` with their grammars and drafts."""

    feed: list[tuple[int, RequestGrammar, list[int]]] = field(default_factory=list)
    mask_step: int | None = None
    rows: list[int] = field(default_factory=list)
    grammars: list[RequestGrammar] = field(default_factory=list)
    drafts: list[Sequence[int]] = field(default_factory=list)


@dataclass(slots=True)
class GrammarJobResult:
    complete: list[int]  # handles whose grammar the fed tokens completed (they end with `stop`)
    broken: list[int]  # handles whose matcher refused a fed token (an engine bug: they end with an error)
    mask: GrammarBitmask | None
    num_fed: int  # tokens fed
    feed_span: tuple[float, float]  # perf_counter times on the grammar thread
    mask_span: tuple[float, float]


def default_feed_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarJobRunner:
    """Runs jobs (one at a time: the caller serializes them) and keeps the figures telemetry shows."""

    # Feeding splits into chunks of at least this many matchers (a batch call costs a few us per token).
    MIN_CHUNK = 64

    def __init__(self, backend: Callable[[], object], words: int, feed_threads: int | None = None) -> None:
        """`backend()`: the GrammarBackend (waits for it the first time)."""
        self._backend = backend
        self.words = words
        self.feed_threads = default_feed_threads() if feed_threads is None else feed_threads
        self._pool: ThreadPoolExecutor | None = None
        self._buffer = np.zeros((0, words), np.int32)
        # Figures (written by the thread that runs jobs): masks made, rows in them, seconds spent.
        self.num_masks = 0
        self.num_mask_rows = 0
        self.mask_seconds = 0.0
        self.num_fed = 0
        self.feed_seconds = 0.0
        # Draft positions masked (speculative decoding), and drafts the grammar forbade there.
        self.num_draft_positions = 0
        self.num_drafts_forbidden = 0

    def run(self, job: GrammarJob) -> GrammarJobResult:
        start = time.perf_counter()
        complete, broken, fed = self._feed(job.feed)
        fed_at = time.perf_counter()
        mask = None if job.mask_step is None else self._mask(job)
        end = time.perf_counter()
        self.num_fed += fed
        self.feed_seconds += fed_at - start
        if mask is not None:
            self.num_masks += 1
            self.num_mask_rows += len(mask.rows) // 4
            self.mask_seconds += end - fed_at
        return GrammarJobResult(complete, broken, mask, fed, (start, fed_at), (fed_at, end))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ feeding

    def _feed(self, feed: list[tuple[int, RequestGrammar, list[int]]]) -> tuple[list[int], list[int], int]:
        """Each grammar takes its tokens, position by position (one batched call per position).
        A matcher that refuses a token is broken and takes nothing more; one whose grammar the
        tokens complete is reported complete."""
        complete: list[int] = []
        broken: list[int] = []
        stops = self._backend().stop_token_ids
        active = [item for item in feed if item[2] and not item[1].broken]
        fed = 0
        depth = 0
        while active:
            ok = self._accept([g.matcher for _, g, _ in active], [tokens[depth] for _, _, tokens in active])
            fed += len(active)
            further = []
            for item, good in zip(active, ok):
                handle, g, tokens = item
                if not good:
                    g.broken = True
                    broken.append(handle)
                    continue
                g.num_accepted += 1
                if depth + 1 < len(tokens):
                    further.append(item)
                elif tokens[depth] in stops and g.matcher.is_terminated():
                    g.terminated = True
                    complete.append(handle)
            active = further
            depth += 1
        return complete, broken, fed

    def _accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        backend = self._backend()
        n = len(matchers)
        chunks = min(self.feed_threads, n // self.MIN_CHUNK)
        if chunks <= 1:
            return backend.accept_tokens(matchers, tokens)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.feed_threads, thread_name_prefix="grammar-feed")
        bounds = np.linspace(0, n, chunks + 1).astype(int).tolist()
        futures: list[Future] = [self._pool.submit(backend.accept_tokens, matchers[a:b], tokens[a:b])
                                 for a, b in zip(bounds, bounds[1:])]
        return [good for future in futures for good in future.result()]

    # ------------------------------------------------------------------ masks

    def _mask(self, job: GrammarJob) -> GrammarBitmask:
        """The next-token masks of the job's rows, one per position each samples (module
        docstring of core/grammar_masks.py for draft positions). Rows whose grammar is complete
        (the token after it is thrown away) or broken sample unmasked."""
        rows, matchers, drafts = [], [], []
        for row, g, row_drafts in zip(job.rows, job.grammars, job.drafts):
            if g.broken or g.terminated:
                continue
            rows.append(row)
            matchers.append(g.matcher)
            drafts.append(row_drafts)
        entries = len(rows) + sum(len(d) for d in drafts)
        if len(self._buffer) < entries:
            self._buffer = np.zeros((max(entries, 2 * len(self._buffer)), self.words), np.int32)
        entry_rows, positions = self._fill(rows, matchers, drafts, self._buffer)
        distinct, which = distinct_rows(self._buffer[:len(entry_rows)])
        return GrammarBitmask(job.mask_step, pack_ids(entry_rows), pack_ids(which), self.words, distinct.tobytes(),
                              pack_ids(positions) if len(entry_rows) > len(rows) else b"")

    def _fill(self, rows: list[int], matchers: list, drafts: list, out: np.ndarray) -> tuple[list[int], list[int]]:
        """Fill `out`'s first entries with each row's masks, position by position: the masks of
        every row at position j (batched), then each row that drafts further takes its j-th draft
        (a row whose draft the grammar forbids, or whose grammar it completes, stops there). The
        matchers end where they began. Returns each entry's (batch row, position)."""
        entry_rows: list[int] = []
        positions: list[int] = []
        if not rows:
            return entry_rows, positions
        backend = self._backend()
        if not any(drafts):  # the usual step: one position per row
            backend.fill_bitmask(matchers, out)
            return rows, [0] * len(rows)
        stops = backend.stop_token_ids
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
                # (a draft that ends the grammar ends the request)
                if drafts[i][depth] not in stops or not matchers[i].is_terminated():
                    active.append(i)
            depth += 1
        back = [i for i, n in enumerate(taken) if n]
        backend.rollback([matchers[i] for i in back], [taken[i] for i in back])
        return entry_rows, positions


def distinct_rows(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of `masks` [n, words] in order of first appearance, each row's index
    among them). Rows are grouped by a 64-bit fingerprint, then each is compared with its group's
    first row; a fingerprint shared by different rows falls back to sorting the rows themselves
    (sorting 256 rows of 16 KB that are mostly equal costs ~20 ms: every comparison reads a row)."""
    n = len(masks)
    if n <= 1:
        return masks.copy(), np.zeros(n, np.int32)
    masks = np.ascontiguousarray(masks)
    _, first, inverse = np.unique(_fingerprints(masks), return_index=True, return_inverse=True)
    if not np.array_equal(masks, masks[first[inverse]]):
        keys = masks.view(np.dtype((np.void, masks.shape[1] * 4))).ravel()
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty(len(first), np.int32)
    rank[order] = np.arange(len(first), dtype=np.int32)
    return masks[first[order]], rank[inverse.ravel()]


_MULTIPLIERS: dict[int, np.ndarray] = {}


def _fingerprints(masks: np.ndarray) -> np.ndarray:
    """uint64 per row: its words (as uint64 pairs, zero-padded) dotted with fixed random odd
    multipliers, wrapping (not collision-free: distinct_rows checks)."""
    words = masks.shape[1]
    if words % 2:
        masks = np.concatenate([masks, np.zeros((len(masks), 1), masks.dtype)], axis=1)
    pairs = masks.view(np.uint64)
    multipliers = _MULTIPLIERS.get(pairs.shape[1])
    if multipliers is None:
        rng = np.random.default_rng(pairs.shape[1])
        multipliers = rng.integers(0, 2**63, size=pairs.shape[1], dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        _MULTIPLIERS[pairs.shape[1]] = multipliers
    return pairs @ multipliers
