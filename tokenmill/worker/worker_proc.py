"""A worker process: `python -m tokenmill.worker.worker_proc <WorkerLaunch as JSON>`.

Reads messages from the shared-memory ring in order and runs them on its `Worker`; the
driver (TP rank 0 of the last pipeline stage) replies to every step, every rank replies to
setup calls. Any exception is
reported as an `ErrorReport` before the process exits; the engine core treats that, or
any exit it did not ask for, as fatal.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import zmq

from tokenmill.child_process import die_with_parent, exit_now, init_child_process
from tokenmill.errors import error_report
from tokenmill.metrics.gc_pauses import freeze_heap
from tokenmill.protocol import (GrammarBitmask, SchedulerOutput, WorkerCall, WorkerCallResult, WorkerInputKind,
                                WorkerLaunch, WorkerOutputKind)
from tokenmill.transport.channels import REPLY_HEAD
from tokenmill.transport.shm_ring import RingAbortedError, ShmRingReader
from tokenmill.worker.fault_injection import FaultInjector

logger = logging.getLogger(__name__)

MASK_POLL_S = 2e-5  # the longest sleep between polls of the ring while a step waits for its masks
# Pipeline parallelism on GPUs: the longest sleep between polls for the next step. A stage's device
# may sit idle until its worker sees the step (the first stage, each time a micro-batch comes back
# from the last): the default backoff (up to 1 ms) would add half a millisecond to each round.
PIPELINE_POLL_S = 5e-5

_CALLS = ("load_model", "available_kv_blocks", "kv_block_bytes", "weight_bytes", "init_kv_cache",
          "telemetry_snapshot", "reset_telemetry", "held_requests")


class WorkerProc:
    def __init__(self, launch: WorkerLaunch, ctx: zmq.Context, faults: FaultInjector | None = None) -> None:
        """`faults`: tests only (see fault_injection.py)."""
        self.launch = launch
        self.faults = faults
        self.rank = launch.rank
        self.reply = ctx.socket(zmq.PUSH)
        self.reply.setsockopt(zmq.SNDHWM, 0)
        self.reply.connect(launch.reply_addr)
        self.ring: ShmRingReader | None = None
        self.worker = None
        self._parent = launch.parent_pid

    def send(self, kind: WorkerOutputKind, payload: bytes = b"") -> None:
        self.reply.send_multipart([REPLY_HEAD.pack(kind, self.rank), payload], copy=False)

    def parent_gone(self) -> bool:
        return os.getppid() != self._parent

    def run(self) -> int:
        try:
            from tokenmill.worker.worker import Worker, rank_device

            self.ring = ShmRingReader(self.launch.ring_name, self.rank, self.launch.overflow_addr,
                                      self.reply.context)
            config = self.launch.config
            worker = self.worker = Worker(config, self.rank, self.launch.dist_init_method,
                                          rank_device(config, self.rank), self.faults)
            self.send(WorkerOutputKind.READY)
            logger.debug("worker %d ready", self.rank)
            self._loop(worker)
            return 0
        except RingAbortedError:
            return 1  # the engine core is gone; nobody to tell
        except BaseException as exc:
            logger.exception("worker %d failed", self.rank)
            self.send(WorkerOutputKind.ERROR, msgspec.msgpack.encode(error_report(exc)))
            return 1
        finally:
            if self.worker is not None:
                self.worker.shutdown()  # writes its trace part, if tracing
            if self.ring is not None:
                self.ring.close()
            self.reply.close(linger=2000)  # deliver the last reply before exiting

    def _loop(self, worker) -> None:
        step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        call_decoder = msgspec.msgpack.Decoder(WorkerCall)
        mask_decoder = msgspec.msgpack.Decoder(GrammarBitmask)
        encoder = msgspec.msgpack.Encoder()
        driver = self.rank == self.launch.config.parallel.driver_rank
        pending = None  # a launched step whose reply is not sent yet
        telemetry = worker.telemetry
        steps, results = telemetry.channel("steps"), telemetry.channel("results")
        calls, call_results = telemetry.channel("worker_calls"), telemetry.channel("worker_call_results")
        clock = time.perf_counter
        config = self.launch.config
        poll_s = PIPELINE_POLL_S if config.parallel.pipeline_parallel_size > 1 and config.device.startswith("cuda") \
            else 1e-3

        def flush() -> None:
            nonlocal pending
            if pending is not None:
                start = clock()
                output = pending.output()
                read = clock()
                args = {"step": output.step_id}
                telemetry.record("readback", start, read, args)
                if driver:
                    payload = encoder.encode(output)
                    encoded = clock()
                    self.send(WorkerOutputKind.RESULT, payload)
                    sent = clock()
                    results.encoded(len(payload) + REPLY_HEAD.size, encoded - read)
                    telemetry.record("encode", read, encoded, args)
                    telemetry.record("send", encoded, sent, args)
                pending = None

        while True:
            # While the device runs the pending step, take the next one if it arrives, so
            # that it is launched before the pending step's tokens are read back.
            while pending is not None and not self.ring.ready():
                if pending.done():
                    flush()
                else:
                    time.sleep(0)
            message = memoryview(self.ring.read(self.parent_gone, max_sleep_s=poll_s))
            kind = message[0]
            if kind == WorkerInputKind.EXECUTE:
                start = clock()
                scheduler_output = step_decoder.decode(message[1:])
                decoded = clock()
                steps.decoded(len(message), decoded - start)
                telemetry.record("decode", start, decoded, {"step": scheduler_output.step_id})
                step = worker.launch_model(scheduler_output)
                flush()
                pending = step
                if scheduler_output.awaits_bitmask:
                    # Structured outputs: the core sends this step's masks once it has the tokens
                    # `flush` just sent; nothing else comes before them. The device may be idle
                    # for them: poll closely (the default backoff sleeps up to 1 ms).
                    message = memoryview(self.ring.read(self.parent_gone, max_sleep_s=MASK_POLL_S))
                    if message[0] != WorkerInputKind.BITMASK:
                        raise ValueError(f"expected the grammar masks of step {scheduler_output.step_id}, "
                                         f"got message kind {message[0]}")
                    worker.finish_step(mask_decoder.decode(message[1:]))
                continue
            flush()
            if kind == WorkerInputKind.CALL:
                start = clock()
                call = call_decoder.decode(message[1:])
                calls.decoded(len(message), clock() - start)
                if call.method not in _CALLS:
                    raise ValueError(f"unknown worker call {call.method!r}")
                method = getattr(worker, call.method)
                value = method() if call.arg is None else method(call.arg)
                if call.method == "init_kv_cache":  # start-up's last call: its heap, out of the collector's way
                    freeze_heap()
                start = clock()
                payload = encoder.encode(WorkerCallResult(value))
                call_results.encoded(len(payload) + REPLY_HEAD.size, clock() - start)
                self.send(WorkerOutputKind.CALL_RESULT, payload)
            elif kind == WorkerInputKind.SHUTDOWN:
                return
            else:
                raise ValueError(f"unknown worker message kind {kind}")


def main(argv: list[str]) -> int:
    init_child_process()
    launch = msgspec.json.decode(argv[1], type=WorkerLaunch)
    die_with_parent(launch.parent_pid, launch.death_signal)
    logging.basicConfig(level=launch.log_level,
                        format=f"%(asctime)s %(levelname)s worker{launch.rank} %(name)s: %(message)s")
    faults = FaultInjector.from_env(os.environ)  # tests only; never set by the engine
    if faults is not None:
        logger.warning("worker %d: test fault injection is on: %s", launch.rank, faults.plan)
    ctx = zmq.Context()
    code = WorkerProc(launch, ctx, faults).run()
    ctx.term()
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv))
