"""Continuous batching without phases: each step, every request's computed-token
count catches up with its token count under a token budget.

Running requests go first (in arrival order), then waiting ones (FCFS). Long
prompts are chunked by the budget. When blocks run out, the newest running
request is preempted: its blocks go back and it is recomputed later (the prefix
cache usually returns most of them).

Async scheduling: a request whose sampled token is still in flight may be
scheduled again; the unknown token counts as a placeholder (`num_pending`)
that the worker fills in from its previous step's sampled ids.

Cost: the running requests are rows of a `RunningTable`. A step computes every row's
token count with numpy and visits in Python only the rows that need attention: a new
block, a block to register in the prefix cache, a preemption. `update` appends the
sampled tokens and checks stop conditions the same way (see `step_update`), so a steady
decode step costs O(changes) Python work, not O(batch).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.running_table import NEVER, RunningTable
from tokenmill.core.step_update import apply_step
from tokenmill.protocol import (CachedRequestData, EngineCoreOutputs, FinishReason, ModelRunnerOutput,
                                NewRequestData, SchedulerOutput, SchedulerStats, pack_ids)
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.protocol.digest import batch_digest

logger = logging.getLogger(__name__)


@dataclass
class _NewBlocks:
    """Blocks a step appends to running requests' tables (the workers get them as CachedRequestData)."""

    handles: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # every handle's, in handle order


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.table = RunningTable(config.max_num_seqs)
        self.known_to_workers: set[int] = set()
        self.finished_to_send: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.batch_order = BatchOrder()
        self._batch_slots = np.empty(0, np.int64)  # the last batch's rows, as slots
        self._batch_version = -1  # the table's version when the last batch was made
        # Steps up to this id need no planning: every running row is a one-token decode with
        # room in its blocks (see `_quiet_steps`); events that break that reset it to 0.
        self._quiet_until = 0
        self._ones_cache = np.ones(0, np.int64)
        # The EOS ids most requests stop on (set by the first that has any): checked with numpy.
        self._common_eos: frozenset[int] | None = None
        self.eos_ids = np.empty(0, np.int64)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        needed = self.kv.blocks_needed(request.num_prompt_tokens + request.max_output_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_output_tokens}) needs {needed} KV blocks, but the cache has only "
                f"{self.kv.num_blocks} blocks of {self.block_size} tokens")
        if request.eos_token_ids and self._common_eos is None:
            self._common_eos = request.eos_token_ids
            self.eos_ids = np.array(sorted(request.eos_token_ids), np.int64)
        self.requests[request.handle] = request
        self.waiting.append(request)

    def abort(self, handles: list[int]) -> None:
        for handle in handles:
            request = self.requests.get(handle)
            if request is not None:
                request.finish_reason = FinishReason.ABORT
                self.finish([request])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> list[Request]:
        """Running requests in priority order (for tests and debugging; O(batch))."""
        return [self.table.requests[slot] for slot in self.table.order.tolist()]

    @property
    def num_pending(self) -> dict[int, int]:
        """Live requests with sampled tokens in flight: handle -> how many (O(batch))."""
        t = self.table
        pending = {int(t.handle[s]): int(t.num_pending[s]) for s in t.order.tolist() if t.num_pending[s]}
        pending.update((r.handle, r.num_pending) for r in self.waiting if r.num_pending)
        return pending

    def stats(self) -> SchedulerStats:
        return SchedulerStats(self.table.num_running, len(self.waiting), self.kv.usage,
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None when nothing can run now."""
        t = self.table
        step_id = self.step_id + 1
        budget = self.config.max_num_batched_tokens
        preempted: list[int] = []
        grown = _NewBlocks()

        quiet = step_id <= self._quiet_until and t.num_running > 0
        if quiet:  # every running row takes one more token and needs no block: skip the planning
            sched_slots = t.order
            sched_counts = self._ones(len(sched_slots))
            t.num_computed[sched_slots] += 1
            t.num_pending[sched_slots] += 1
        else:
            slots = t.order.copy()
            num_new, attention_rows, steady = self._plan_running(slots, budget)
            num_rows = self._serve_attention_rows(slots, num_new, attention_rows, preempted, grown)
            slots, num_new = slots[:num_rows], num_new[:num_rows]
            computed = t.num_computed[slots] + num_new
            t.num_computed[slots] = computed
            t.num_pending[slots] += (num_new > 0) & (computed == t.num_tokens[slots] + t.num_pending[slots])
            scheduled = num_new > 0
            sched_slots, sched_counts = slots[scheduled], num_new[scheduled]
            self._quiet_until = step_id + self._quiet_steps(sched_slots) if steady and not preempted else 0
        budget -= len(sched_slots) if quiet else int(sched_counts.sum())

        new_requests: list[NewRequestData] = []
        admitted: list[int] = []
        if not preempted:
            admitted, admitted_counts = self._admit(budget, new_requests)
            if admitted:
                sched_slots = np.concatenate([sched_slots, admitted])
                sched_counts = np.concatenate([sched_counts, admitted_counts])
                admitted_slots = np.array(admitted)
                if (t.num_computed[admitted_slots] == t.num_tokens[admitted_slots]).all():
                    self._quiet_until = min(self._quiet_until, step_id + self._quiet_steps(admitted_slots))
                else:
                    self._quiet_until = 0  # a chunked prompt: its next step is not one token

        if not len(sched_slots) and not preempted and not self.finished_to_send:
            return None
        self.step_id = step_id
        output = SchedulerOutput(
            step_id=step_id, new_requests=new_requests,
            cached_requests=CachedRequestData.pack(grown.handles, grown.counts, grown.block_ids),
            finished_handles=self.finished_to_send, preempted_handles=preempted)
        if quiet and not admitted and self._batch_version == t.version:
            self.batch_order.encode_same_rows(output)  # the rows of the last batch, one token each
            output.row_slots = self._batch_slots
        else:
            self._encode_batch(output, sched_slots, sched_counts)
        output.table_version = self._batch_version = t.version
        check_every = self.config.debug_check_every
        if check_every and step_id % check_every == 0:
            output.digest = batch_digest((h, int(t.num_computed[s]), self.kv.blocks[h]) for h, s in
                                         zip(output.batch_handles.tolist(), output.row_slots.tolist()))
        self.finished_to_send = []
        return output

    def _quiet_steps(self, slots: np.ndarray) -> int:
        """How many more steps these rows, each a one-token decode from now on (one token
        in flight or known but not computed), can run without planning: none needs a block,
        fills one, or reaches its token limit."""
        if not len(slots):
            return 1 << 62
        t = self.table
        computed = t.num_computed[slots]
        room = np.minimum(t.block_capacity[slots] - computed,
                          np.minimum(t.next_full_block_at[slots], t.token_limit[slots]) - computed - 1)
        return max(int(room.min()), 0)

    def _plan_running(self, slots: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """Tokens to schedule per running row (in priority order, until the budget runs out),
        the rows that need attention (a new block, or a full block to register), and whether
        every row is a one-token decode within the budget."""
        t = self.table
        known = t.num_tokens[slots]
        ahead = known + t.num_pending[slots]  # placeholders included
        computed = t.num_computed[slots]
        # A request whose last token is already in flight takes no more.
        uncomputed = (ahead - computed) * (ahead < t.token_limit[slots])
        before = uncomputed.cumsum() - uncomputed
        num_new = np.minimum(uncomputed, (budget - before).clip(0))
        after = computed + num_new
        attention = (num_new > 0) & ((after > t.block_capacity[slots])
                                     | (np.minimum(after, known) >= t.next_full_block_at[slots]))
        steady = len(slots) <= budget and bool((uncomputed == 1).all())
        return num_new, attention.nonzero()[0], steady

    def _serve_attention_rows(self, slots: np.ndarray, num_new: np.ndarray, rows: np.ndarray,
                              preempted: list[int], grown: _NewBlocks) -> int:
        """Give the rows that need it their blocks, in priority order, preempting from the tail
        when the pool is short. Returns how many leading rows of `slots` still run."""
        num_rows = len(slots)
        if not len(rows) or self._serve_in_bulk(slots[rows], num_new[rows], grown):
            return num_rows
        for i in rows.tolist():
            if i >= num_rows:
                break
            slot, n = int(slots[i]), int(num_new[i])
            blocks = self._grow(slot, n)
            while blocks is None:
                victim = int(slots[num_rows - 1])
                preempted.append(int(self.table.handle[victim]))
                self._preempt(victim)
                num_rows -= 1
                if victim == slot:
                    return num_rows
                blocks = self._grow(slot, n)
            if blocks:
                grown.handles.append(int(self.table.handle[slot]))
                grown.counts.append(len(blocks))
                grown.block_ids.extend(blocks)
        return num_rows

    def _serve_in_bulk(self, slots: np.ndarray, num_new: np.ndarray, grown: _NewBlocks) -> bool:
        """`_serve_attention_rows` without a Python call per block: when the pool has room for
        all the rows and no prefix-cache entry that this step registers is also one that its
        allocations evict, doing every allocation first and then every registration ends in the
        same state as doing them row by row. Otherwise (False) change nothing."""
        t, kv, bs = self.table, self.kv, self.block_size
        after = t.num_computed[slots] + num_new
        num_blocks = np.maximum(-(-after // bs) - t.block_capacity[slots] // bs, 0)
        total = int(num_blocks.sum())
        if total > kv.pool.num_free:
            return False
        known = np.minimum(after, t.num_tokens[slots])
        registering = np.flatnonzero(known >= t.next_full_block_at[slots]).tolist()
        if total and registering:
            evicted = kv.pool.hashes_evicted_by(total)
            if evicted and any(not evicted.isdisjoint(kv.hashes_to_cache(
                    int(t.handle[slots[i]]), int(known[i]), t.token_row(slots[i]), t.requests[slots[i]].block_hashes))
                    for i in registering):
                return False
        if total:
            taken = kv.pool.allocate(total)
            growing = num_blocks > 0
            handles, counts = t.handle[slots[growing]].tolist(), num_blocks[growing].tolist()
            start = 0
            for handle, count in zip(handles, counts):
                kv.append_blocks(handle, taken[start:start + count])
                start += count
            grown.handles.extend(handles)
            grown.counts.extend(counts)
            grown.block_ids.extend(taken)
            t.block_capacity[slots] += num_blocks * bs
        if registering:
            reg_slots, reg_known = slots[registering], known[registering]
            handles, chains = t.handle[reg_slots].tolist(), [t.requests[s].block_hashes for s in reg_slots.tolist()]
            first_token = t.next_full_block_at[reg_slots] - bs
            if (reg_known < first_token + 2 * bs).all():  # each fills one block: hash them together
                kv.cache_next_blocks(handles, t.tokens[reg_slots[:, None], first_token[:, None] + np.arange(bs)], chains)
            else:
                for slot, handle, num_tokens, chain in zip(reg_slots.tolist(), handles, reg_known.tolist(), chains):
                    kv.cache_full_blocks(handle, num_tokens, t.tokens[slot], chain)
            t.next_full_block_at[reg_slots] = (reg_known // bs + 1) * bs
        return True

    def _grow(self, slot: int, num_new: int) -> list[int] | None:
        """Blocks for a running row's next `num_new` tokens, and prefix-cache registration of the
        blocks they fill; None (nothing changed) when the pool is short."""
        t = self.table
        handle, computed = int(t.handle[slot]), int(t.num_computed[slot])
        blocks = self.kv.allocate(handle, computed, num_new)
        if blocks is None:
            return None
        if blocks:
            t.block_capacity[slot] += len(blocks) * self.block_size
        known = min(computed + num_new, int(t.num_tokens[slot]))
        if known >= t.next_full_block_at[slot]:
            request = t.requests[slot]
            assert request is not None
            num_cached = self.kv.cache_full_blocks(handle, known, t.token_row(slot), request.block_hashes)
            t.next_full_block_at[slot] = (num_cached + 1) * self.block_size
        return blocks

    def _admit(self, budget: int, new_requests: list[NewRequestData]) -> tuple[list[int], list[int]]:
        """Start waiting requests (FCFS) while budget, seats and blocks allow; returns their
        slots and scheduled token counts."""
        t, kv, bs = self.table, self.kv, self.block_size
        slots: list[int] = []
        counts: list[int] = []
        while self.waiting and budget > 0 and t.num_running < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:  # a preempted request's token is still in flight
                break
            tokens = request.token_ids
            assert tokens is not None
            # Prompt logprobs need every prompt position computed, so they skip the prefix cache.
            cached = [] if request.params.prompt_logprobs is not None else kv.find_cached_prefix(
                tokens, request.block_hashes)
            num_hit = len(cached) * bs
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            num_new = min(len(tokens) - num_hit, budget)
            if kv.allocate(request.handle, num_hit, num_new, cached) is None:
                break
            self.waiting.popleft()
            kv.record_lookup(len(tokens), num_hit)
            computed = num_hit + num_new
            num_cached = kv.cache_full_blocks(request.handle, min(computed, len(tokens)), tokens,
                                              request.block_hashes)
            blocks = kv.blocks[request.handle]
            self.known_to_workers.add(request.handle)
            new_requests.append(NewRequestData(
                handle=request.handle, token_ids=tokens.astype("<i4", copy=False).tobytes(),
                num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.params,
                block_ids=pack_ids(blocks), num_computed_tokens=num_hit))
            request.status = RequestStatus.RUNNING
            on_eos = bool(request.eos_token_ids) and request.eos_token_ids == self._common_eos
            custom = bool(request.stop_token_ids) or (bool(request.eos_token_ids) and not on_eos)
            slot = t.add(request, computed, len(blocks) * bs,
                         (num_cached + 1) * bs if kv.enable_caching else NEVER, on_eos, custom)
            if computed == len(tokens):
                t.num_pending[slot] = 1  # this step samples its next token
            slots.append(slot)
            counts.append(num_new)
            budget -= num_new
        return slots, counts

    def _encode_batch(self, so: SchedulerOutput, sched_slots: np.ndarray, sched_counts: np.ndarray) -> None:
        """The batch as a diff against the last one: rows whose request is still scheduled stay
        in their order, the rest leave; newly scheduled requests join at the end."""
        t = self.table
        prev = self._batch_slots
        count_of = np.zeros(t.max_rows, np.int64)
        count_of[sched_slots] = sched_counts
        # A slot may hold another request by now: compare handles too.
        kept = (count_of[prev] > 0) & (t.handle[prev] == self.batch_order.handles)
        if len(prev) == len(sched_slots) and kept.all():
            batch_slots, added = prev, np.empty(0, np.int64)
        else:
            in_kept = np.zeros(t.max_rows, bool)
            in_kept[prev[kept]] = True
            added_slots = sched_slots[~in_kept[sched_slots]]
            batch_slots = np.concatenate([prev[kept], added_slots])
            added = t.handle[added_slots]
        self.batch_order.encode(so, kept, added, count_of[batch_slots])
        self._batch_slots = so.row_slots = batch_slots

    def _preempt(self, slot: int) -> None:
        request = self.table.requests[slot]
        assert request is not None
        self.table.move_out(slot)
        self.kv.free(request.handle)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.known_to_workers.discard(request.handle)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.info("preempted request %d (%d tokens); %d preemptions so far",
                    request.handle, request.num_tokens, self.num_preemptions)

    # ------------------------------------------------------------------ update

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Apply a finished step's sampled tokens; return what the front-end must hear."""
        result = apply_step(self.table, self.requests, self.eos_ids, scheduler_output, runner_output)
        if not result.steady:
            self._quiet_until = 0
        if result.finished:
            self.finish(result.finished)
        return result.outputs

    def _ones(self, n: int) -> np.ndarray:
        if len(self._ones_cache) != n:
            self._ones_cache = np.ones(n, np.int64)
        return self._ones_cache

    def finish(self, requests: list[Request]) -> None:
        """End these requests (their `finish_reason` is set): free their rows and blocks, and
        tell the workers with the next step."""
        on_table = [r.slot for r in requests if r.slot >= 0]
        if on_table:
            self.table.remove(on_table)
        for request in requests:
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED
            self.kv.free(request.handle)
            del self.requests[request.handle]
            if request.handle in self.known_to_workers:
                self.known_to_workers.discard(request.handle)
                self.finished_to_send.append(request.handle)
