"""Continuous batching without phases: each step, every request's computed-token
count catches up with its token count under a token budget.

Running requests go first (in arrival order), then waiting ones (FCFS). Long
prompts are chunked by the budget. When blocks run out, the newest running
request is preempted: its blocks go back and it is recomputed later (the prefix
cache usually returns most of them).

Async scheduling: a request whose sampled token is still in flight may be
scheduled again; the unknown token counts as a placeholder (`num_pending`)
that the worker fills in from its previous step's sampled ids.
"""

from __future__ import annotations

import logging
from collections import deque

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.protocol import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs, FinishReason,
                                ModelRunnerOutput, NewRequestData, SchedulerOutput, SchedulerStats, pack_ids)
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.protocol.digest import batch_digest

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_pending: dict[int, int] = {}  # handle -> sampled tokens still in flight
        self.known_to_workers: set[int] = set()
        self.finished_to_send: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.batch_order = BatchOrder()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        needed = self.kv.blocks_needed(request.num_prompt_tokens + request.max_output_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_output_tokens}) needs {needed} KV blocks, but the cache has only "
                f"{self.kv.num_blocks} blocks of {self.block_size} tokens")
        self.requests[request.handle] = request
        self.waiting.append(request)

    def abort(self, handles: list[int]) -> None:
        for handle in handles:
            request = self.requests.get(handle)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
            self._finish(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None when nothing can run now."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        new_blocks: dict[int, list[int]] = {}
        preempted: list[int] = []
        new_requests: list[NewRequestData] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._num_uncomputed(request), budget)
            if num_new <= 0:
                i += 1
                continue
            blocks = self.kv.allocate(request, num_new)
            while blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.handle)
                if victim is request:
                    break
                blocks = self.kv.allocate(request, num_new)
            if blocks is None:
                break
            scheduled.append((request, num_new))
            if blocks:
                new_blocks[request.handle] = blocks
            budget -= num_new
            i += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if self.num_pending.get(request.handle):  # a preempted request's token is still in flight
                break
            # Prompt logprobs need every prompt position computed, so they skip the prefix cache.
            cached = [] if request.params.prompt_logprobs is not None else self.kv.find_cached_prefix(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = len(cached) * self.block_size
            num_hit = len(cached) * self.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv.allocate(request, num_new, cached) is None:
                break
            request.num_computed_tokens = num_hit
            self.waiting.popleft()
            self.kv.record_lookup(request.num_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        if not scheduled and not preempted and not self.finished_to_send:
            return None

        cached_data = CachedRequestData()
        for request, num_new in scheduled:
            handle = request.handle
            if handle not in self.known_to_workers:
                self.known_to_workers.add(handle)
                new_requests.append(NewRequestData(
                    handle=handle, token_ids=pack_ids(request.token_ids),
                    num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.params,
                    block_ids=pack_ids(self.kv.blocks[handle]),
                    num_computed_tokens=request.num_computed_tokens))
            elif handle in new_blocks:
                cached_data.handles.append(handle)
                cached_data.new_block_ids.append(pack_ids(new_blocks[handle]))
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens + self.num_pending.get(handle, 0):
                self.num_pending[handle] = self.num_pending.get(handle, 0) + 1

        self.step_id += 1
        output = SchedulerOutput(
            step_id=self.step_id, new_requests=new_requests,
            cached_requests=cached_data if cached_data.handles else None,
            finished_handles=self.finished_to_send, preempted_handles=preempted)
        self.batch_order.encode(output, {r.handle: n for r, n in scheduled})
        check_every = self.config.debug_check_every
        if check_every and self.step_id % check_every == 0:
            output.digest = batch_digest((h, self.requests[h].num_computed_tokens, self.kv.blocks[h])
                                         for h in output.scheduled_handles)
        self.finished_to_send = []
        return output

    def _num_uncomputed(self, request: Request) -> int:
        pending = self.num_pending.get(request.handle, 0)
        if request.num_output_tokens + pending >= request.max_output_tokens:
            return 0  # its last token is already in flight
        return request.num_tokens + pending - request.num_computed_tokens

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.known_to_workers.discard(request.handle)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.info("preempted request %d (%d tokens); %d preemptions so far",
                    request.handle, request.num_tokens, self.num_preemptions)

    # ------------------------------------------------------------------ update

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Apply a finished step's sampled tokens; return what the front-end must hear."""
        outputs: list[EngineCoreOutput] = []
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        handles = scheduler_output.scheduled_handles
        for row, (handle, sampled) in enumerate(zip(handles, runner_output.rows(len(handles)))):
            prompt_lp = prompt_logprobs[row] if prompt_logprobs else None
            if not sampled:
                if prompt_lp is not None and handle in self.requests:
                    outputs.append(EngineCoreOutput(handle=handle, new_token_ids=[], prompt_logprobs=prompt_lp))
                continue
            self.num_pending[handle] -= 1
            request = self.requests.get(handle)
            if request is None or request.is_finished:
                continue  # finished or aborted while this step was in flight
            new_tokens = []
            finished = False
            for token in sampled:
                new_tokens.append(token)
                if request.append_output(token):
                    finished = True
                    break
            if finished:
                self._remove_running(request)
                self._finish(request)
            outputs.append(EngineCoreOutput(
                handle=handle, new_token_ids=new_tokens, finish_reason=request.finish_reason,
                stop_token_id=request.stop_token_id,
                logprobs=logprobs[row] if logprobs else None, prompt_logprobs=prompt_lp,
                num_cached_tokens=max(request.num_cached_tokens, 0)))
        for handle in list(self.num_pending):
            if self.num_pending[handle] == 0 and handle not in self.requests:
                del self.num_pending[handle]
        return EngineCoreOutputs(outputs=outputs)

    def _remove_running(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
        del self.requests[request.handle]
        if request.handle in self.known_to_workers:
            self.known_to_workers.discard(request.handle)
            self.finished_to_send.append(request.handle)
        if not self.num_pending.get(request.handle):
            self.num_pending.pop(request.handle, None)
