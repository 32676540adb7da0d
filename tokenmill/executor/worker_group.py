"""A group of worker processes: messages broadcast through a shared-memory ring, replies over ZMQ.

Every message to the workers goes through one `ShmRingWriter` (msgpack, first byte = kind).
Replies come back on one PULL socket as [kind, rank, payload]: the driver (TP rank 0 of the
last pipeline stage) answers each step with its `ModelRunnerOutput`; every rank answers setup
calls. With several ranks, they meet for torch.distributed at a TCP store on a free local
port (rank 0 hosts it; NCCL still uses it after start-up, for communicators it makes lazily).
A reader thread matches replies to futures strictly FIFO per rank, and doubles as the liveness monitor:
when a worker exits unasked, every pending and later future fails with `EngineDeadError`
and `on_failure` is called, so an idle engine core hears of it too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq

from tokenmill.child_process import spawn_child, spawned_by_main_thread, stop_process
from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError, exception_from_report
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.protocol import (ErrorReport, GrammarBitmask, ModelRunnerOutput, SchedulerOutput, WorkerCall,
                                WorkerCallResult, WorkerInputKind, WorkerLaunch, WorkerOutputKind)
from tokenmill.transport.channels import LAST_WORDS_S, POLL_MS, REPLY_HEAD, EngineAddresses, free_port
from tokenmill.transport.shm_ring import RingAbortedError, ShmRingWriter

logger = logging.getLogger(__name__)


class _Pending:
    """One message's expected replies: from the driver only (a step) or from every rank (a call)."""

    def __init__(self, ranks: set[int], driver: int | None = None) -> None:
        self.future: Future = Future()  # the driver's value if `driver` is set, else rank -> value
        self.waiting = set(ranks)
        self.values: dict[int, object] = {}
        self.driver = driver

    def deliver(self, rank: int, value: object) -> None:
        self.values[rank] = value
        self.waiting.discard(rank)
        if not self.waiting and not self.future.done():
            self.future.set_result(self.values if self.driver is None else self.values[self.driver])

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class WorkerGroup:
    """Starts the workers at once (`wait_ready()` waits for them), so the caller can do its own
    setup meanwhile. Imports no torch: the engine core starts its workers before loading torch."""

    def __init__(self, config: EngineConfig, addresses: EngineAddresses,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.world_size = config.parallel.world_size
        self.driver_rank = config.parallel.driver_rank
        self._on_failure = on_failure
        self._ctx = zmq.Context()
        self._reply = self._ctx.socket(zmq.PULL)
        self._reply.setsockopt(zmq.LINGER, 0)
        self._reply.bind(addresses.worker_replies)
        overflow = [addresses.ring_overflow(rank) for rank in range(self.world_size)]
        self._ring = ShmRingWriter(addresses.ring_name, self.world_size, overflow, self._ctx)
        self._lock = threading.Lock()  # guards _pending and _dead together
        self._pending: list[deque[_Pending]] = [deque() for _ in range(self.world_size)]
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._worker_error: str | None = None  # a worker's last words, if it reported an exception
        self._step_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._result_decoder = msgspec.msgpack.Decoder(WorkerCallResult)
        self._error_decoder = msgspec.msgpack.Decoder(ErrorReport)
        self._step_encoder = msgspec.msgpack.Encoder()
        self._mask_encoder = msgspec.msgpack.Encoder()
        # This side's message counters (encodes of steps and calls, decodes of their replies).
        self.channels = {name: MessageStats() for name in ("steps", "results", "worker_calls", "worker_call_results",
                                                            "masks")}
        self._procs = []
        self._ready = self._expect(set(range(self.world_size)))
        dist_init = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else ""
        self._reader = threading.Thread(target=self._read_replies, name="worker-replies", daemon=True)
        try:
            for rank in range(self.world_size):
                self._procs.append(spawn_child("tokenmill.worker.worker_proc", WorkerLaunch(
                    config=config, rank=rank, ring_name=addresses.ring_name,
                    overflow_addr=overflow[rank], reply_addr=addresses.worker_replies, parent_pid=os.getpid(),
                    log_level=logging.getLogger("tokenmill").getEffectiveLevel(),
                    death_signal=spawned_by_main_thread(), dist_init_method=dist_init)))
            self._reader.start()
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Raises the first worker's startup exception (or EngineDeadError) if one fails."""
        self._ready.future.result()
        self._ring.unlink()  # every worker has it mapped; now it goes away with the last of us

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Broadcast a step; the future resolves to the driver's output, strictly in order."""
        start = time.perf_counter()
        buf = bytearray((WorkerInputKind.EXECUTE,))
        self._step_encoder.encode_into(scheduler_output, buf, 1)
        self.channels["steps"].encoded(len(buf), time.perf_counter() - start)
        pending = self._expect({self.driver_rank}, driver=self.driver_rank)
        self._send(buf)
        return pending.future

    def send_bitmask(self, mask: GrammarBitmask) -> None:
        """A step's grammar masks (structured outputs): no reply; the step's own reply follows."""
        start = time.perf_counter()
        buf = bytearray((WorkerInputKind.BITMASK,))
        self._mask_encoder.encode_into(mask, buf, 1)
        self.channels["masks"].encoded(len(buf), time.perf_counter() - start)
        self._send(buf)

    def call(self, method: str, arg: int | None = None) -> list:
        """Run a setup call on every worker; their return values in rank order."""
        pending = self._expect(set(range(self.world_size)))
        start = time.perf_counter()
        message = bytes((WorkerInputKind.CALL,)) + msgspec.msgpack.encode(WorkerCall(method, arg))
        self.channels["worker_calls"].encoded(len(message), time.perf_counter() - start)
        self._send(message)
        values = pending.future.result()
        return [values[rank] for rank in range(self.world_size)]

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._ready.future.done():  # still starting (the caller failed meanwhile): no goodbyes
            for proc in self._procs:
                proc.kill()
        elif self._dead is None and self._procs and all(p.poll() is None for p in self._procs):
            try:
                self._ring.write(bytes((WorkerInputKind.SHUTDOWN,)), should_abort=self._any_worker_exited)
            except RingAbortedError:
                pass
        for proc in self._procs:
            stop_process(proc, timeout_s=5.0)
        if self._reader.is_alive():
            self._reader.join()  # it returns within a poll interval once the workers are gone
        self._fail_all(EngineDeadError("the executor was shut down"))
        self._ring.close()
        self._reply.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ internals

    def _expect(self, ranks: set[int], driver: int | None = None) -> _Pending:
        pending = _Pending(ranks, driver)
        with self._lock:
            if self._dead is not None:
                pending.fail(self._dead)
            else:
                for rank in ranks:
                    self._pending[rank].append(pending)
        return pending

    def _send(self, data: bytes | bytearray) -> None:
        if self._dead is not None:
            return  # the pending entry has already failed
        try:
            self._ring.write(data, should_abort=lambda: self._dead is not None)
        except RingAbortedError:
            pass  # the reader thread fails the pending entries

    def _any_worker_exited(self) -> bool:
        return any(p.poll() is not None for p in self._procs)

    def _read_replies(self) -> None:
        """Runs until every worker has exited; fails everything if one exits unasked."""
        while True:
            if self._reply.poll(POLL_MS):
                self._handle(self._reply.recv_multipart(copy=False))
                continue
            exited = [(rank, p.returncode) for rank, p in enumerate(self._procs) if p.poll() is not None]
            if not exited:
                continue
            if self._closing:
                return
            deadline = time.monotonic() + LAST_WORDS_S
            while self._reply.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self._handle(self._reply.recv_multipart(copy=False))
            rank, code = exited[0]
            reason = self._worker_error or f"worker {rank} died unexpectedly (exit code {code})"
            logger.error(reason)
            self._fail_all(EngineDeadError(reason))
            if self._on_failure is not None:
                self._on_failure(reason)
            return

    def _handle(self, frames) -> None:
        kind, rank = REPLY_HEAD.unpack(frames[0].bytes)
        payload = frames[1].buffer
        with self._lock:
            pending = self._pending[rank].popleft() if self._pending[rank] else None
        if kind == WorkerOutputKind.ERROR:
            exc = exception_from_report(self._error_decoder.decode(payload), f"worker {rank}")
            self._worker_error = f"worker {rank} failed: {type(exc).__name__}: {exc}"
            if pending is not None:
                pending.fail(exc)
            return
        if pending is None:
            logger.warning("unexpected reply of kind %d from worker %d", kind, rank)
            return
        nbytes = len(payload) + REPLY_HEAD.size
        start = time.perf_counter()
        if kind == WorkerOutputKind.RESULT:
            value = self._step_decoder.decode(payload)
            self.channels["results"].decoded(nbytes, time.perf_counter() - start)
            pending.deliver(rank, value)
        elif kind == WorkerOutputKind.CALL_RESULT:
            value = self._result_decoder.decode(payload).value
            if rank == self.driver_rank:
                self.channels["worker_call_results"].decoded(nbytes, time.perf_counter() - start)
            pending.deliver(rank, value)
        elif kind == WorkerOutputKind.READY:
            pending.deliver(rank, None)

    def _fail_all(self, exc: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = exc
            entries = [p for queue in self._pending for p in queue]
            for queue in self._pending:
                queue.clear()
        for pending in entries:
            pending.fail(exc)

