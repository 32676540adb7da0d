"""Continuous batching without phases: each step, every request's computed-token
count catches up with its token count under a token budget.

Running requests go first (in arrival order), then waiting ones (FCFS). Long
prompts are chunked by the budget. When blocks run out, the newest running
request is preempted: its blocks go back and it is recomputed later (the prefix
cache usually returns most of them).

Async scheduling: a request whose sampled token is still in flight may be
scheduled again; the unknown token counts as a placeholder (`num_pending`)
that the worker fills in from its previous step's sampled ids.

Cost: the running requests are rows of a `RunningTable` (numpy columns). `RunningPlanner`
plans only the rows due for a look (the others are one-token decodes with room in their
blocks) and visits in Python only rows that get a block, register one, or are preempted;
`step_update` appends the sampled tokens and screens stop conditions with numpy. The
batch goes to the workers as a diff (`BatchOrder`), made from slot arrays. So a steady
decode step costs O(changes) Python work, plus a few numpy operations over the rows.
Requests leave and join the table on admission, preemption and finish (O(changes)).

Pipeline parallelism (`pipeline_stages` > 1): up to one batch per stage (or `pp_microbatches`) is in flight. No row
is scheduled past the tokens the scheduler knows (`RunningPlanner.no_placeholders`), each
batch's budget is an even share of the work in sight (`microbatch.py`), and each row's first
input token travels with the step (`pp_input_tokens`) for the first stage.

LoRA (`enable_lora`): an admitted request pins its adapter's device slot (`LoRASlotTable`) until
it finishes or is preempted; one whose adapter finds no free slot waits while later requests
may start, so no step mixes more adapters than slots. A slot's (re)fill travels as a
`LoRALoad` with the step; a request's arrival asks the workers to read its adapter ahead.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import numpy as np

from tokenmill.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.microbatch import pipeline_token_budget
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.row_failures import fail_rows
from tokenmill.core.running_plan import RunningPlanner
from tokenmill.core.running_table import NEVER, RunningTable
from tokenmill.core.spec_policy import ProposerState, SpecPolicy, SpecStats, allows_speculation
from tokenmill.core.step_update import apply_step
from tokenmill.lora.slots import LoRASlotTable
from tokenmill.protocol import (CachedRequestData, EngineCoreOutputs, FinishReason, LoRALoad, ModelRunnerOutput,
                                NewRequestData, SchedulerOutput, SchedulerStats, pack_ids)
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.protocol.digest import batch_digest

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 speculative: SpeculativeConfig | None = None, pipeline_stages: int = 1,
                 kv_window: int | None = None, lora: LoRAConfig | None = None) -> None:
        """`kv_window`: every layer (of the target and any draft) slides with at most this
        window, so blocks behind it are released while requests run (`KVCacheManager`)."""
        self.config = config
        self.pipeline_stages = pipeline_stages
        # Micro-batches each step's budget splits the work in sight into (one per stage by default).
        self.pipeline_batches = max(pipeline_stages, config.pp_microbatches) if pipeline_stages > 1 else 1
        self.in_flight_tokens = 0  # scheduled tokens of the batches not updated yet
        # Pipeline device tokens: the steps in flight (oldest first) and each row's last step. A
        # row whose one token in flight comes from the oldest step may run on it (a placeholder):
        # the first stage takes it from the last on the devices, before the step.
        self.device_tokens = pipeline_stages > 1 and config.pp_device_tokens
        self._in_flight_steps: deque[int] = deque()
        self._row_step = np.zeros(config.max_num_seqs, np.int64)
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_window)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.table = RunningTable(config.max_num_seqs)
        self.planner = RunningPlanner(self.table, self.kv, self._preempt, no_placeholders=pipeline_stages > 1)
        self.spec = SpecPolicy(speculative, self.table) if speculative is not None else None
        self.spec_stats = SpecStats(speculative.num_speculative_tokens if speculative else 0)
        self.proposer = ProposerState(self.table) if speculative is not None else None
        self.known_to_workers: set[int] = set()
        self.finished_to_send: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.batch_order = BatchOrder()
        self._batch_slots = np.empty(0, np.int64)  # the last batch's rows, as slots
        self._batch_version = -1  # the table's version when the last batch was made
        self._batch_is_all_running = False  # the last batch had every running request
        self._last_proposed = -1  # the last step at whose end the workers propose drafts
        # The EOS ids most requests stop on (set by the first that has any): checked with numpy.
        self._common_eos: frozenset[int] | None = None
        self.eos_ids = np.empty(0, np.int64)
        # LoRA: the adapters' device slots (a running request pins its adapter's slot).
        self.loras = LoRASlotTable(lora.max_loras) if lora is not None else None
        self._lora_loads: list[LoRALoad] = []
        # Adapters the workers were asked to read ahead (about their host LRU: its size, newest last).
        self._lora_prefetch: list = []
        self._lora_read_ahead: OrderedDict[int, None] = OrderedDict()
        self._lora_host_slots = lora.max_cpu_loras if lora is not None else 0

    # ------------------------------------------------------------------ requests

    def check_fits(self, request: Request) -> None:
        """ValueError unless the request's adapter is enabled and its prompt and max_tokens fit the KV cache."""
        if request.lora is not None and self.loras is None:
            raise ValueError(f"lora_request: adapter {request.lora.name!r} given, but LoRA is not enabled "
                             f"(enable_lora=True)")
        needed = self.kv.blocks_needed(request.num_prompt_tokens + request.max_output_tokens)
        if self.kv.window is not None:  # held at once: the window, plus one step's tokens
            needed = min(needed, self.kv.blocks_needed(self.kv.window + self.config.max_num_batched_tokens) + 2)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_output_tokens}) needs {needed} KV blocks, but the cache has only "
                f"{self.kv.num_blocks} blocks of {self.block_size} tokens")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        if request.eos_token_ids and self._common_eos is None:
            self._common_eos = request.eos_token_ids
            self.eos_ids = np.array(sorted(request.eos_token_ids), np.int64)
        self.requests[request.handle] = request
        self.waiting.append(request)
        if request.lora is not None:
            self._read_ahead(request.lora)

    def _read_ahead(self, lora) -> None:
        """A request for `lora` arrived: unless its adapter is in a slot or was read lately, the
        workers start reading it into host memory now (in the background), so the step that
        first runs it copies it from there instead of waiting for the disk."""
        if lora.id in self.loras.slot_of:
            return
        if lora.id in self._lora_read_ahead:
            self._lora_read_ahead.move_to_end(lora.id)
            return
        self._lora_read_ahead[lora.id] = None
        while len(self._lora_read_ahead) > self._lora_host_slots:
            self._lora_read_ahead.popitem(last=False)
        self._lora_prefetch.append(lora)

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
        spec = self.spec_stats.snapshot()
        return SchedulerStats(self.table.num_running, len(self.waiting), self.kv.usage,
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions,
                              spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                              spec.accepted_per_position)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None when nothing can run now."""
        t = self.table
        step_id = self.step_id + 1
        budget = self.config.max_num_batched_tokens
        drafts = None
        if self.spec is not None and self._last_proposed == step_id - 1:
            drafts = self.spec.choose(step_id, t.order, budget, self._prompts_can_start())
        placeholder_ok = None
        if self.device_tokens and len(self._in_flight_steps) >= self.pipeline_batches:
            # Once every micro-batch is in flight, the oldest one's rows go again on their tokens
            # in flight (the next the first stage gets): one placeholder each at most, never under
            # a grammar (its mask needs the token on the host). Before that, new work fills the
            # pipeline, so that the micro-batches stay apart.
            placeholder_ok = ((t.num_pending == 1) & (self._row_step == self._in_flight_steps[0])
                              & ~t.structured)
        self.planner.placeholder_ok = placeholder_ok
        if self.pipeline_stages > 1:
            budget = pipeline_token_budget(t, self.waiting, self.in_flight_tokens, self.pipeline_batches, budget,
                                           placeholder_ok)
        plan = self.planner.plan(step_id, budget, drafts)
        sched_slots, sched_counts = plan.slots, plan.counts
        budget -= int(sched_counts.sum())

        new_requests: list[NewRequestData] = []
        admitted: list[int] = []
        if not plan.preempted:
            admitted, admitted_counts = self._admit(budget, new_requests)
            if admitted:
                sched_slots = np.concatenate([sched_slots, admitted])
                sched_counts = np.concatenate([sched_counts, admitted_counts])
                self.planner.set_due_steps(np.array(admitted), step_id)

        if not len(sched_slots) and not plan.preempted and not self.finished_to_send:
            return None
        self.step_id = step_id
        grown = plan.new_blocks
        output = SchedulerOutput(
            step_id=step_id, new_requests=new_requests,
            cached_requests=CachedRequestData.pack(grown.handles, grown.counts, grown.block_ids),
            finished_handles=self.finished_to_send, preempted_handles=plan.preempted)
        if self._lora_loads:
            output.lora_loads, self._lora_loads = self._lora_loads, []
        if self._lora_prefetch:
            output.lora_prefetch, self._lora_prefetch = self._lora_prefetch, []
        if (plan.one_token_each and not admitted and self._batch_version == t.version
                and self._batch_is_all_running):
            self.batch_order.encode_same_rows(output)  # the rows of the last batch, one token each
            output.row_slots = self._batch_slots
        else:
            self._encode_batch(output, sched_slots, sched_counts)
        output.table_version = self._batch_version = t.version
        output.num_drafts = None
        if plan.draft_slots is not None and len(plan.draft_slots):
            per_slot = np.zeros(t.max_rows, np.int64)
            per_slot[plan.draft_slots] = plan.draft_counts
            output.num_drafts = per_slot[output.row_slots]
        if self.spec is not None:
            self._mark_proposals(output)
        if t.num_structured:
            self._mark_structured(output)
        self._batch_is_all_running = len(output.row_slots) == t.num_running
        check_every = self.config.debug_check_every
        if check_every and step_id % check_every == 0:
            output.digest = batch_digest((h, int(t.num_computed[s]), self.kv.blocks[h]) for h, s in
                                         zip(output.batch_handles.tolist(), output.row_slots.tolist()))
        if self.pipeline_stages > 1 and len(output.row_slots):
            rows = output.row_slots
            first = t.num_computed[rows] - output.batch_counts  # each row's first input position
            if placeholder_ok is None:
                output.pp_input_tokens = t.tokens[rows, first].astype("<i4").tobytes()
            else:  # -1: a placeholder (its token comes from the last stage, on the devices)
                known = first < t.num_tokens[rows]
                ids = t.tokens[rows, np.minimum(first, t.tokens.shape[1] - 1)]
                output.pp_input_tokens = np.where(known, ids, -1).astype("<i4").tobytes()
        if self.device_tokens:
            output.pp_tokens_upto = self._in_flight_steps[0] if self._in_flight_steps else step_id - 1
            self._row_step[output.row_slots] = step_id
            self._in_flight_steps.append(step_id)
        self.in_flight_tokens += output.total_num_scheduled_tokens
        self.finished_to_send = []
        return output

    def _mark_proposals(self, output: SchedulerOutput) -> None:
        """Whether the workers propose drafts at the end of this step (and, for that, hold the
        proposer's state), or may drop it."""
        t = self.table
        if not self.spec.wants_proposals(output.step_id, t.num_running, self._prompts_can_start()):
            in_sight = t.num_running + len(self.waiting)
            output.proposer_dormant = self.proposer.idle(saturated=not self.spec.fits(in_sight))
            return
        output.propose = True
        # Workers propose only for rows that sample: not for a prompt chunk short of the end,
        # which would otherwise get drafts when its last chunk is a single token.
        rows = output.row_slots
        sampling = rows[t.num_computed[rows] >= t.num_tokens[rows]]
        t.proposed_at[sampling] = output.step_id
        self._last_proposed = output.step_id
        output.proposer_resume = self.proposer.proposing(sampling)

    def _mark_structured(self, output: SchedulerOutput) -> None:
        """Whether some row samples under a grammar this step (then the workers wait for the step's
        `GrammarBitmask`); which rows (batch indices) and requests, for the engine core (local)."""
        t, rows = self.table, output.row_slots
        rows_of = (t.structured[rows] & (t.num_computed[rows] >= t.num_tokens[rows])).nonzero()[0]
        if len(rows_of):
            output.awaits_bitmask = True
            output.structured_rows = rows_of
            output.structured_handles = t.handle[rows[rows_of]]

    def _prompts_can_start(self) -> bool:
        """Whether prompts wait for a seat that is free (their prefill will take the step's tokens)."""
        return bool(self.waiting) and self.table.num_running < self.config.max_num_seqs

    def _admit(self, budget: int, new_requests: list[NewRequestData]) -> tuple[list[int], list[int]]:
        """Start waiting requests (FCFS) while budget, seats and blocks allow; returns their
        slots and scheduled token counts."""
        t, kv, bs = self.table, self.kv, self.block_size
        slots: list[int] = []
        counts: list[int] = []
        no_lora_slot: list[Request] = []  # waiting for a LoRA slot: later requests may go first
        while self.waiting and budget > 0 and t.num_running < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:  # a preempted request's token is still in flight
                break
            if request.lora is not None and not self.loras.can_acquire(request.lora):
                no_lora_slot.append(self.waiting.popleft())
                continue
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
            lora_slot = -1 if request.lora is None else self.loras.acquire(request.lora, self._lora_loads)
            new_requests.append(NewRequestData(
                handle=request.handle, token_ids=tokens.astype("<i4", copy=False).tobytes(),
                num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.params,
                block_ids=pack_ids(blocks), num_computed_tokens=num_hit, lora_slot=lora_slot,
                prompt_logprobs_from=request.prompt_logprobs_from))
            request.status = RequestStatus.RUNNING
            on_eos = bool(request.eos_token_ids) and request.eos_token_ids == self._common_eos
            custom = bool(request.stop_token_ids) or (bool(request.eos_token_ids) and not on_eos)
            slot = t.add(request, computed, len(blocks) * bs,
                         (num_cached + 1) * bs if kv.enable_caching else NEVER, on_eos, custom,
                         self.spec is not None and allows_speculation(request.params))
            if computed == len(tokens):
                t.num_pending[slot] = 1  # this step samples its next token
            slots.append(slot)
            counts.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(no_lora_slot))
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
        # Every token counted computed was sent to the workers in an earlier step (in flight or
        # done): their prompt logprobs reach the front-end from those steps, never again.
        request.prompt_logprobs_from = max(request.prompt_logprobs_from,
                                           min(int(self.table.num_computed[slot]), request.num_prompt_tokens))
        self.table.move_out(slot)
        self.kv.free(request.handle)
        if request.lora is not None:
            self.loras.release(request.lora)
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
        self.in_flight_tokens -= scheduler_output.total_num_scheduled_tokens
        if self.device_tokens:
            done = self._in_flight_steps.popleft()
            assert done == scheduler_output.step_id, (done, scheduler_output.step_id)  # in order
        result = apply_step(self.table, self.requests, self.eos_ids, scheduler_output, runner_output,
                            self._record_verified if self.spec is not None else None)
        if runner_output.failed_rows:  # rare: rows that failed alone end their requests (row_failures.py)
            result = fail_rows(self.requests, scheduler_output, runner_output, result)
        if result.finished:
            self.finish(result.finished)
        return result.outputs

    def observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """A step done, `seconds` of busy time after the one before (EngineCore): for the
        adaptive policy's measured cost of speculating. Counted only for steps of decode rows
        alone, in one regime: drafts verified and proposed, or neither."""
        if self.spec is None or not self.spec.config.max_step_tokens:
            return
        speculative = so.num_drafts is not None
        rows = len(so.row_slots)
        drafts = int(so.num_drafts.sum()) if speculative else 0
        if speculative == so.propose and rows and so.total_num_scheduled_tokens == rows + drafts:
            self.spec.observe(speculative, rows, seconds, so.step_id)

    def _record_verified(self, slot: int, num_drafts: int, num_accepted: int) -> None:
        self.spec_stats.record(num_drafts, num_accepted)
        if slot >= 0:
            self.spec.record(slot, num_drafts, num_accepted)

    def finish(self, requests: list[Request]) -> None:
        """End these requests (their `finish_reason` is set): free their rows and blocks, and
        tell the workers with the next step."""
        on_table = [r.slot for r in requests if r.slot >= 0]
        if on_table:
            self.table.remove(on_table)
        for request in requests:
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            elif request.lora is not None:
                self.loras.release(request.lora)
            request.status = RequestStatus.FINISHED
            self.kv.free(request.handle)
            del self.requests[request.handle]
            if request.handle in self.known_to_workers:
                self.known_to_workers.discard(request.handle)
                self.finished_to_send.append(request.handle)
