"""The engine core: scheduler plus executor, driven by one loop with a bounded in-flight queue.

`max_in_flight` is 1 for synchronous scheduling and 2 with async scheduling; with pipeline
parallelism it is one batch per stage, or `pp_microbatches` (plus one with async scheduling, so
the first stage has its next batch as soon as it is free). The same `step()` serves every mode.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.errors import EngineDeadError
from tokenmill.executor.base import Executor
from tokenmill.metrics.spec_decode import since
from tokenmill.metrics.stats_logger import StatsLogger
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                                KVCacheStats, ModelRunnerOutput, RowFailure, SchedulerOutput, SchedulerStats,
                                TelemetryReport)

logger = logging.getLogger(__name__)

GRAMMAR_SWITCH_INTERVAL_S = 0.0002  # the GIL switch interval once structured outputs are in use
# With pipeline parallelism, the first stage idles while a micro-batch's result crosses this
# process (the reply reader sets the step's future, the loop applies it and schedules the next):
# no thread should wait out another's Python (the output thread's encoding) for 5 ms.
PIPELINE_SWITCH_INTERVAL_S = 0.0002


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_cls: Callable[[EngineConfig], Executor] | None = None) -> None:
        """`executor_cls`: an Executor class, or any factory taking the config (default: uniproc)."""
        if executor_cls is None:
            from tokenmill.executor.uniproc import UniprocExecutor
            executor_cls = UniprocExecutor
        self.config = config
        self.executor = executor_cls(config)
        num_blocks = self.executor.available_kv_blocks()
        block_size = config.cache.block_size
        max_len = config.model.max_model_len
        if config.kv_window is not None:  # blocks behind the window go back while a request runs
            max_len = min(max_len, config.kv_window + config.scheduler.max_num_batched_tokens + 2 * block_size)
        if num_blocks * block_size < max_len:
            raise ValueError(
                f"kv_cache_memory: the KV cache holds {num_blocks * block_size} tokens "
                f"({num_blocks} blocks), fewer than max_model_len={max_len}; give it more memory "
                f"or lower max_model_len")
        self.executor.init_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); max concurrency at "
                    "max_model_len=%d: %.1fx", num_blocks, block_size, num_blocks * block_size,
                    num_blocks * self.executor.kv_block_bytes() / 2**30, max_len,
                    num_blocks * block_size / max_len)
        self.num_blocks = num_blocks
        self.weight_bytes = self.executor.weight_bytes()
        logger.info("model weights: %.3f GiB", self.weight_bytes / 2**30)
        self.block_bytes = self.executor.kv_block_bytes()
        stages = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, config.speculative,
                                   pipeline_stages=stages, kv_window=config.kv_window, lora=config.lora)
        batches = max(stages, config.scheduler.pp_microbatches) if stages > 1 else 1  # micro-batches in flight
        self.max_in_flight = batches + (1 if config.scheduler.async_scheduling else 0)
        self.stats_logger = StatsLogger(enabled=config.log_stats)
        # (step, its result, when it was scheduled)
        self.in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput], float]] = deque()
        self._last_updated = 0.0  # when the last step's update ended
        self.telemetry = Telemetry("core", config.trace_steps)
        self.telemetry.channels.update(self.executor.channel_stats())
        self._spec_at_reset = self.scheduler.spec_stats.snapshot()  # telemetry reports what came after
        self.grammars = None  # GrammarMasks, made with the first structured-output request
        self._grammar_news: list[EngineCoreOutput] = []  # requests ended by their grammar, for the next outputs
        # Pipeline parallelism schedules no row past the tokens it knows, so a step's masks can be
        # made as soon as it is submitted, and every stage keeps a step in flight.
        self._masks_at_submit = stages > 1
        if stages > 1:
            sys.setswitchinterval(min(sys.getswitchinterval(), PIPELINE_SWITCH_INTERVAL_S))

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request(
            request.handle, np.frombuffer(request.prompt_token_ids, "<i4"), request.sampling_params,
            self.config.model.eos_token_ids, self.config.model.max_model_len,
            request.arrival_time or time.time(), request.lora)
        seed = self.config.model.arch.prefix_cache_seed(core_request.num_prompt_tokens)
        if seed is not None:  # KV that differs for the same tokens: blocks hashed apart
            core_request.block_hashes.seed = hash((core_request.block_hashes.seed, seed))
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(core_request)
            return
        self.scheduler.check_fits(core_request)
        if self.grammars is None:
            from tokenmill.core.grammar_masks import GrammarMasks
            self.grammars = GrammarMasks(self.config, self.telemetry.record)
            # The path from a step's tokens to the next mask crosses threads of this process
            # (the reply reader, the loop, the grammar thread and its feed threads), each taking
            # the GIL back after a library call: none should wait out another's Python for the
            # default 5 ms switch interval (the mid-session H200 trace: ~0.8 ms from a worker's
            # reply to the loop seeing it).
            sys.setswitchinterval(min(sys.getswitchinterval(), GRAMMAR_SWITCH_INTERVAL_S))
        self.grammars.add(core_request)  # scheduled once its grammar is compiled

    def abort_requests(self, handles: list[int]) -> None:
        if self.grammars is not None:
            self.grammars.abort(handles)
        self.scheduler.abort(handles)

    def has_work(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.in_flight) or bool(self._grammar_news)
                or (self.grammars is not None and (bool(self.grammars.compiling) or self.grammars.busy())))

    def step(self) -> EngineCoreOutputs:
        """Fill the in-flight queue, then wait for the oldest step and apply it.
        Each phase (schedule, submit, wait, update) is timed in `telemetry`."""
        record, clock = self.telemetry.record, time.perf_counter
        if self.grammars is not None and self.grammars.compiling:
            self._admit_compiled()
        while len(self.in_flight) < self.max_in_flight:
            if self.in_flight and self._mask_not_started(self.in_flight[-1][0]):
                break  # its mask (which needs an earlier step's tokens) must reach the workers first
            if self.grammars is not None and self.grammars.ready():
                self._settle_masks()  # news known before scheduling spares a finished request's row
            start = clock()
            batch = self.scheduler.schedule()
            if batch is None:
                break
            scheduled = clock()
            self._settle_masks()  # every mask started goes to the workers before this step
            ready = clock()
            future = self.executor.submit(batch)
            submitted = clock()
            args = {"step": batch.step_id}
            record("schedule", start, scheduled, args)
            record("submit", ready, submitted, args)
            self.in_flight.append((batch, future, start))
            if self._masks_at_submit and batch.awaits_bitmask:
                self._start_masks(batch)  # its rows have no token in flight: the mask can be made now
            self._start_due_masks()
        if not self.in_flight:
            if self.grammars is not None:
                self._settle_masks()  # tokens of the last step: which grammars they completed
                if not self.in_flight and not self._grammar_news:
                    self.grammars.wait(0.01)  # only grammars compiling: wait for one, do not spin
            return self._with_grammar_news(EngineCoreOutputs(outputs=[], timestamp=time.time()))
        batch, future, scheduled_at = self.in_flight.popleft()
        self._settle_masks()  # the step's mask goes out before its result is awaited
        start = clock()
        result = self._wait(batch, future)
        done = clock()
        requests, table = self.scheduler.requests, self.scheduler.table
        if result.draft_rows:  # constrained rows' drafts for the next step (its mask needs them)
            self.grammars.take_drafts(batch, result, requests)
        # The next mask starts before the update when the step's tokens can be read off its result.
        fed = batch.awaits_bitmask and self.grammars.feed_sampled(batch, result, requests, table)
        if fed:
            self._start_due_masks(ship=False)  # (its news is applied after the update's)
        outputs = self._with_grammar_news(self.scheduler.update(batch, result))
        if batch.awaits_bitmask and not fed:
            self.grammars.feed(batch, requests, table)
        self._start_due_masks()
        self.stats_logger.record_step(batch.total_num_scheduled_tokens,
                                      outputs.num_new_tokens())
        self.stats_logger.maybe_log(self.scheduler.stats())
        updated = clock()
        # The step's busy time: since the previous update, or since it was scheduled if the engine
        # had been idle (or runs one step at a time).
        self.scheduler.observe_step(batch, updated - max(self._last_updated, scheduled_at))
        self._last_updated = updated
        args = {"step": batch.step_id}
        record("wait", start, done, args)
        record("update", done, updated, args)
        outputs.timestamp = time.time()
        return outputs

    # ------------------------------------------------------------------ structured outputs

    def _admit_compiled(self) -> None:
        ready, failed = self.grammars.take_compiled()
        for request in ready:
            self.scheduler.add_request(request)
        for request, _ in failed:
            self._grammar_news.append(EngineCoreOutput(request.handle, [], FinishReason.ERROR,
                                                       failure=RowFailure.GRAMMAR))

    def _mask_not_started(self, batch: SchedulerOutput) -> bool:
        return batch.awaits_bitmask and not getattr(batch, "mask_started", False)

    def _start_due_masks(self, ship: bool = True) -> None:
        """The oldest step in flight has every earlier step applied: its mask can be made now,
        with the tokens handed over; else those tokens alone (which grammars they complete)."""
        if self.in_flight and self._mask_not_started(self.in_flight[0][0]):
            self._start_masks(self.in_flight[0][0], ship)
        elif self.grammars is not None and self.grammars.has_feed():
            self.grammars.start(None, self.scheduler.requests, self.scheduler.table)
        if ship:
            self._settle_if_inline()

    def _start_masks(self, batch: SchedulerOutput, ship: bool = True) -> None:
        self.grammars.start(batch, self.scheduler.requests, self.scheduler.table)
        batch.mask_started = True
        if ship:
            self._settle_if_inline()

    def _settle_if_inline(self) -> None:
        if self.grammars is not None and not self.config.structured.mask_thread:
            self._settle_masks()  # the work was done on the loop: ship it now

    def _settle_masks(self) -> None:
        """Wait for the grammar thread's pending jobs; send their masks (in step order: each is
        the next message its workers read) and apply their news: a request whose grammar is
        complete ends with `stop`, one whose matcher refused a token with an error (reported with
        the next outputs). The core calls this before it submits a step, waits for a result or
        calls the workers otherwise."""
        if self.grammars is None or not self.grammars.busy():
            return
        clock, record = time.perf_counter, self.telemetry.record
        start = clock()
        results = self.grammars.settle()
        waited = clock()
        if waited - start > 1e-4:
            record("mask_wait", start, waited)
        complete, broken = [], []
        requests = self.scheduler.requests
        for result, batch in results:
            if result.mask is not None:
                sending = clock()
                self.executor.send_bitmask(result.mask)
                record("send_mask", sending, clock(), {"step": batch.step_id})
            complete += [r for r in map(requests.get, result.complete) if r is not None]
            broken += [r for r in map(requests.get, result.broken) if r is not None]
        for request in complete:
            request.finish_reason = FinishReason.STOP
            self._grammar_news.append(EngineCoreOutput(request.handle, [], FinishReason.STOP))
        for request in broken:
            logger.error("request %d: a token broke its grammar", request.handle)
            request.finish_reason = FinishReason.ERROR
            self._grammar_news.append(EngineCoreOutput(request.handle, [], FinishReason.ERROR,
                                                       failure=RowFailure.GRAMMAR))
        if complete or broken:
            self.scheduler.finish(complete + broken)

    def _with_grammar_news(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """`outputs` plus requests ended by their grammar since the last outputs (none of them is
        in `outputs`: a request gets no tokens after it ended)."""
        if self._grammar_news:
            outputs.outputs.extend(self._grammar_news)
            self._grammar_news = []
        return outputs

    def _wait(self, batch: SchedulerOutput, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        """The step's result; a step that runs past `step_timeout_s` (a worker alive but stuck)
        ends the engine: nothing else would ever notice it."""
        try:
            return future.result(timeout=self.config.step_timeout_s)
        except FutureTimeout:
            raise EngineDeadError(f"step {batch.step_id} did not finish within step_timeout="
                                  f"{self.config.step_timeout_s:g} s (a worker is hung)") from None

    def kv_cache_stats(self) -> KVCacheStats:
        pool = self.scheduler.kv.pool
        return KVCacheStats(num_free_blocks=pool.num_free, num_blocks=pool.num_blocks,
                            num_requests=len(self.scheduler.requests), block_bytes=self.block_bytes)

    def scheduler_stats(self) -> SchedulerStats:
        return msgspec.structs.replace(self.scheduler.stats(), num_kv_blocks=self.num_blocks,
                                       weight_bytes=self.weight_bytes)

    def telemetry_report(self) -> TelemetryReport:
        """This process's telemetry, then each worker's; speculation counters since the last reset."""
        self._settle_masks()  # the workers read the pending masks before any call
        speculation = (since(self._spec_at_reset, self.scheduler.spec_stats.snapshot())
                       if self.config.speculative is not None else None)
        return TelemetryReport([self.telemetry.snapshot(), *self.executor.worker_telemetry()], speculation)

    def reset_telemetry(self) -> None:
        # Same thread as the counters' writer (the step loop: utility calls run between steps).
        self._settle_masks()
        self._spec_at_reset = self.scheduler.spec_stats.snapshot()
        self.telemetry.reset()
        self.executor.reset_worker_telemetry()

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()  # (a pending mask is not sent: the workers stop anyway)
        self.executor.shutdown()
        self.telemetry.close()
