"""The engine core's structured outputs: grammars compiled off the loop, one matcher per request,
advanced as tokens come back, and each step's token bitmask, both on a grammar thread.

Which token a mask is for: a step's mask must follow every token sampled before it. With async
scheduling step N+1 is launched while step N runs, before N's tokens are known, so the mask of
N+1 cannot be made when N+1 is scheduled. It is made just in time instead: the worker runs N+1's
forward pass, sends N's tokens and waits for the mask. The core applies N's tokens to its
requests, hands them over with N+1's rows (`start`), and goes on with its loop (the outputs,
scheduling N+2) while the grammar thread feeds the matchers and fills N+1's mask
(core/grammar_job.py). The core waits for the thread (`settle`) only where it must ship the mask:
before it submits anything later (the mask is the next message the worker reads) or waits for
N+1's result. So the mask's work overlaps N+1's forward pass and the core's own work; the device
waits only if the mask comes later than the forward pass ends (the step trace says: the worker's
`await_mask` spans, the core's `grammar_feed`, `mask` and `mask_wait` spans).

Ownership: while a job is pending the grammar thread owns every matcher; the core builds jobs
from its own state (the tokens it appended, `RequestGrammar.num_fed`, the drafts) and reads the
thread's results (grammars completed, matchers broken) at `settle`, before it applies any later
step, so a request whose grammar is complete ends with `stop` before another token of it could
be reported. A step scheduled before that news is known may carry the finished request's row:
its token is thrown away, as for any request that finishes with a step in flight.

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
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from tokenmill.config import EngineConfig
from tokenmill.core.grammar_job import GrammarJob, GrammarJobResult, GrammarJobRunner, RequestGrammar, distinct_rows
from tokenmill.core.request import Request
from tokenmill.protocol import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from tokenmill.structured_output.backend import GrammarBackend, bitmask_words
from tokenmill.structured_output.compiles import GrammarCompiles
from tokenmill.structured_output.grammar_spec import grammar_spec

__all__ = ["GrammarMasks", "RequestGrammar", "distinct_rows"]

logger = logging.getLogger(__name__)


class GrammarMasks:
    def __init__(self, config: EngineConfig, record: Callable[..., None] | None = None) -> None:
        """`record(name, start_s, end_s, args)`: telemetry for the grammar thread's spans
        (`grammar_feed`, `mask`), called on the thread that runs the job."""
        self.config = config
        self._record = record
        self.compiles = GrammarCompiles(self._make_backend, config.structured.compile_timeout_s)
        self.compiling: dict[int, tuple[Request, Future]] = {}
        self.words = bitmask_words(config.model.arch.vocab_size)
        self.runner = GrammarJobRunner(lambda: self.compiles.backend().result(), self.words)
        self._thread: ThreadPoolExecutor | None = None  # the grammar thread (made with the first job)
        self._feed: list[tuple[int, RequestGrammar, list[int]]] = []  # tokens handed over, in no job yet
        self._pending: deque[tuple[Future[GrammarJobResult], SchedulerOutput | None]] = deque()
        self.num_constrained = 0

    def _make_backend(self) -> GrammarBackend:
        path = self.config.structured.vocab_file
        if not path:
            raise RuntimeError("structured outputs: the front-end gave no vocabulary file")
        with open(path) as f:
            return GrammarBackend.from_json(f.read(), self.config.structured)

    # The grammar thread's figures (read them once it is idle).
    @property
    def num_draft_positions(self) -> int:
        return self.runner.num_draft_positions

    @property
    def num_drafts_forbidden(self) -> int:
        return self.runner.num_drafts_forbidden

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

    # ------------------------------------------------------------------ steps (the core's thread)

    def feed(self, so: SchedulerOutput, requests: dict[int, Request], table) -> None:
        """Hand over the tokens `so`'s update appended to its constrained requests (they go to the
        grammar thread with the next job)."""
        handles = getattr(so, "structured_handles", None)
        if handles is not None:
            self._take_tokens(handles.tolist(), requests, table)

    def feed_sampled(self, so: SchedulerOutput, out: ModelRunnerOutput, requests: dict[int, Request], table) -> bool:
        """Hand over `so`'s sampled tokens straight from its result, before the scheduler applies
        them, so the next mask can start at once. True if done; False (nothing handed over) when
        the step needs the scheduler's update first: rows that verified drafts or sampled other than
        one token, failed rows, or a request with tokens not handed over yet (caught up from the
        table instead). A request the update finishes still takes its token (it is appended too)."""
        if getattr(so, "num_drafts", None) is not None or out.count_rows or out.failed_rows:
            return False
        handles = getattr(so, "structured_handles", None)
        if handles is None:
            return False
        tokens = out.sampled_tokens()
        items = []
        for row, handle in zip(so.structured_rows.tolist(), handles.tolist()):
            request = requests.get(handle)
            if request is None or request.grammar is None:
                continue
            g = request.grammar
            known = table.num_tokens[request.slot] if request.slot >= 0 else len(request.token_ids)
            if request.num_prompt_tokens + g.num_fed != known:
                return False
            items.append((handle, g, [int(tokens[row])]))
        for _, g, _ in items:
            g.num_fed += 1
        self._feed += items
        return True

    def take_drafts(self, so: SchedulerOutput, out: ModelRunnerOutput, requests: dict[int, Request]) -> None:
        """Keep the drafts step `so` proposed for its constrained rows (for the next step's mask)."""
        rows, drafts = out.draft_arrays()
        handles = so.batch_handles
        for row, row_drafts in zip(rows.tolist(), drafts.tolist()):
            request = requests.get(int(handles[row]))
            if request is not None and request.grammar is not None:
                request.grammar.drafts = row_drafts
                request.grammar.drafts_step = so.step_id

    def start(self, so: SchedulerOutput | None, requests: dict[int, Request], table) -> None:
        """Start a job on the grammar thread: the tokens handed over, then (unless `so` is None)
        the masks of `so`'s constrained rows, whose earlier steps are all applied. Each of those
        rows first takes any token of its request not handed over yet (one that came back while
        the request was preempted, say), so a mask always follows every known token."""
        job = self._job(so, requests, table)
        if not self.config.structured.mask_thread:  # on the core's loop, as before (for comparison)
            done: Future[GrammarJobResult] = Future()
            done.set_result(self._run(job))
            self._pending.append((done, so))
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pending.append((self._thread.submit(self._run, job), so))

    def _run(self, job: GrammarJob) -> GrammarJobResult:
        result = self.runner.run(job)
        if self._record is not None:
            if result.num_fed:
                self._record("grammar_feed", *result.feed_span, {"tokens": result.num_fed})
            if result.mask is not None:
                mask = result.mask
                distinct = len(mask.bitmask) // (4 * mask.words) if mask.words else 0
                self._record("mask", *result.mask_span, {"step": job.mask_step, "rows": len(mask.rows) // 4,
                                                         "distinct": distinct})
        return result

    def has_feed(self) -> bool:
        return bool(self._feed)

    def busy(self) -> bool:
        """Whether tokens or jobs wait to be settled."""
        return bool(self._feed or self._pending)

    def ready(self) -> bool:
        """Whether the oldest pending job is done (settling it would not block)."""
        return bool(self._pending) and self._pending[0][0].done()

    def settle(self, block: bool = True) -> list[tuple[GrammarJobResult, SchedulerOutput | None]]:
        """The pending jobs' results in order (with the step each masks); without `block`, only
        those already done. A job that raised raises here."""
        results = []
        while self._pending and (block or self._pending[0][0].done()):
            future, so = self._pending.popleft()
            results.append((future.result(), so))
        return results

    def _job(self, so: SchedulerOutput | None, requests: dict[int, Request], table) -> GrammarJob:
        job = GrammarJob()
        if so is not None:
            num_drafts = getattr(so, "num_drafts", None)
            self._take_tokens(so.structured_handles.tolist(), requests, table)
            job.mask_step = so.step_id
            for row, handle in zip(so.structured_rows.tolist(), so.structured_handles.tolist()):
                request = requests.get(handle)
                if request is None or request.grammar is None:
                    continue  # finished by the step before (the row's token is thrown away)
                g = request.grammar
                k = 0 if num_drafts is None else int(num_drafts[row])
                if k:
                    assert g.drafts_step == so.step_id - 1 and len(g.drafts) >= k, (
                        f"request {handle}: step {so.step_id} verifies {k} drafts; the core has {len(g.drafts)} "
                        f"from step {g.drafts_step}")
                job.rows.append(row)
                job.grammars.append(g)
                job.drafts.append(g.drafts[:k] if k else ())
        job.feed, self._feed = self._feed, []
        return job

    def _take_tokens(self, handles: list[int], requests: dict[int, Request], table) -> None:
        """Each request's output tokens not handed over yet (from its row of `table` while it runs,
        else from the request) into the feed."""
        for handle in handles:
            request = requests.get(handle)
            if request is None or request.grammar is None:
                continue  # finished in this update, or aborted
            g = request.grammar
            first = request.num_prompt_tokens + g.num_fed
            if request.slot >= 0:
                new = table.tokens[request.slot, first:table.num_tokens[request.slot]]
            else:
                new = request.token_ids[first:]
            if len(new):
                g.num_fed += len(new)
                self._feed.append((handle, g, new.tolist()))

    # ------------------------------------------------------------------ one step at a time (tests)

    def advance(self, so: SchedulerOutput, requests: dict[int, Request], table) -> tuple[list[Request], list[Request]]:
        """Feed `so`'s constrained requests their new tokens on the calling thread; the requests
        whose grammar is now complete and those whose matcher refused a token."""
        assert not self._pending
        self.feed(so, requests, table)
        result = self.runner.run(self._job(None, requests, table))
        return [requests[h] for h in result.complete], [requests[h] for h in result.broken]

    def bitmask(self, so: SchedulerOutput, requests: dict[int, Request], table) -> GrammarBitmask:
        """`so`'s masks made on the calling thread."""
        assert not self._pending
        return self.runner.run(self._job(so, requests, table)).mask

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self.runner.shutdown()
        self.compiles.shutdown()
