"""The engine-core process: `python -m tokenmill.core.engine_core_proc <CoreLaunch as JSON>`.

Three threads:
- input: receives [kind, payload] from the front-end, decodes it, queues it;
- busy loop (main): drains the queue, runs `EngineCore.step()` while there is work and
  blocks on the queue when idle; answers utility calls between steps;
- output: encodes and sends what the loop produced.
The core never detokenizes. Startup ends with READY, or with an ErrorReport (then exit 1);
any later failure, including a dead worker, also ends with an ErrorReport and exit 1.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import time

import msgspec
import zmq

from tokenmill.child_process import die_with_parent, exit_now, init_child_process
from tokenmill.errors import EngineDeadError, error_report
from tokenmill.metrics.gc_pauses import freeze_heap
from tokenmill.protocol import (AbortRequests, CoreInputKind, CoreLaunch, CoreOutputKind, EngineCoreOutput,
                                EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, FinishReason, UtilityCall,
                                UtilityResult)
from tokenmill.transport.channels import HEARTBEAT_S, EngineAddresses

logger = logging.getLogger(__name__)

_UTILITIES = ("kv_cache_stats", "scheduler_stats", "telemetry_report", "reset_telemetry")


class _Fatal:
    """Queued by the executor's monitor thread (or a broken input thread) so that even an idle
    busy loop wakes up and dies."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EngineCoreProc:
    def __init__(self, launch: CoreLaunch, ctx: zmq.Context) -> None:
        self.launch = launch
        self.addresses = EngineAddresses(launch.run_dir)
        self.input_sock = ctx.socket(zmq.PULL)
        self.input_sock.connect(self.addresses.core_input)
        self.output_sock = ctx.socket(zmq.PUSH)
        self.output_sock.setsockopt(zmq.SNDHWM, 0)
        self.output_sock.connect(self.addresses.core_output)
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()  # (kind, struct), or None to stop
        self.engine = None
        self._stop = threading.Event()
        self._input = threading.Thread(target=self._input_thread, name="core-input", daemon=True)

    # ------------------------------------------------------------------ main

    def run(self) -> int:
        from tokenmill.executor.worker_group import WorkerGroup

        workers = None
        try:
            config = self.launch.config
            if config.parallel.backend == "ray":  # ranks are Ray actors, possibly on other nodes
                from tokenmill.core.engine_core import EngineCore
                from tokenmill.executor.ray_executor import RayExecutor
                self.engine = EngineCore(config, RayExecutor)
            else:
                # Workers first, before this process imports torch: their startup (imports,
                # config, model) overlaps with ours.
                workers = WorkerGroup(config, self.addresses,
                                      on_failure=lambda reason: self.inputs.put(_Fatal(reason)))
                from tokenmill.core.engine_core import EngineCore
                from tokenmill.executor.multiproc import MultiprocExecutor
                self.engine = EngineCore(config, functools.partial(MultiprocExecutor, workers=workers))
        except BaseException as exc:
            logger.error("engine core failed to start: %s: %s", type(exc).__name__, exc)
            if workers is not None:
                workers.shutdown()
            self._send(CoreOutputKind.ERROR, error_report(exc))
            return 1
        freeze_heap()  # start-up's heap, out of the collector's way (gc_pauses.py)
        self._input.start()
        output_thread = threading.Thread(target=self._output_thread, name="core-output", daemon=True)
        output_thread.start()
        self.outputs.put((CoreOutputKind.READY, EngineCoreReady(self.engine.num_blocks,
                                                                config.cache.block_size)))
        code = 0
        try:
            self._busy_loop()
        except BaseException as exc:
            logger.error("engine core failed: %s: %s", type(exc).__name__, exc)
            self.outputs.put((CoreOutputKind.ERROR, error_report(exc)))
            code = 1
        finally:
            self.outputs.put(None)
            output_thread.join(timeout=5.0)
            self.engine.shutdown()
        return code

    def _busy_loop(self) -> None:
        """While there is work, outputs go out at least every HEARTBEAT_S (empty ones if a step
        has no news), so the front-end can tell a slow engine from a stalled one."""
        engine = self.engine
        last_sent = time.monotonic()
        while True:
            item = self.inputs.get() if not engine.has_work() else None
            while True:
                if item is not None and not self._handle(item):
                    return
                try:
                    item = self.inputs.get_nowait()
                except queue.Empty:
                    break
            if engine.has_work():
                outputs = engine.step()
                if not outputs.is_empty() or time.monotonic() - last_sent >= HEARTBEAT_S:
                    self.outputs.put((CoreOutputKind.OUTPUTS, outputs))
                    last_sent = time.monotonic()

    def _handle(self, item) -> bool:
        """Apply one input; False on shutdown."""
        if isinstance(item, _Fatal):
            raise EngineDeadError(item.reason)
        kind, message = item
        if kind == CoreInputKind.ADD:
            try:
                self.engine.add_request(message)
            except ValueError as exc:  # the front-end validates first; this is a last guard
                logger.error("rejected request %d: %s", message.handle, exc)
                self.outputs.put((CoreOutputKind.OUTPUTS, EngineCoreOutputs(
                    [EngineCoreOutput(message.handle, [], FinishReason.ABORT)])))
        elif kind == CoreInputKind.ABORT:
            self.engine.abort_requests(message.handles)
        elif kind == CoreInputKind.UTILITY:
            self.outputs.put((CoreOutputKind.UTILITY_RESULT, self._utility(message)))
        elif kind == CoreInputKind.SHUTDOWN:
            return False
        return True

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in _UTILITIES:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        return UtilityResult(call.call_id, getattr(self.engine, call.method)())

    # ------------------------------------------------------------------ I/O threads

    def _input_thread(self) -> None:
        """Owns the input socket once started (ZMQ sockets are single-threaded)."""
        decoders = {CoreInputKind.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
                    CoreInputKind.ABORT: msgspec.msgpack.Decoder(AbortRequests),
                    CoreInputKind.UTILITY: msgspec.msgpack.Decoder(UtilityCall)}
        telemetry = self.engine.telemetry
        channels = {CoreInputKind.ADD: telemetry.channel("requests"),
                    CoreInputKind.ABORT: telemetry.channel("requests"),
                    CoreInputKind.UTILITY: telemetry.channel("utility_calls")}
        try:
            while not self._stop.is_set():
                if not self.input_sock.poll(100):
                    continue
                kind_frame, payload = self.input_sock.recv_multipart(copy=False)
                kind = CoreInputKind(kind_frame.bytes[0])
                if kind == CoreInputKind.SHUTDOWN:
                    self.inputs.put((kind, None))
                    return
                start = time.perf_counter()
                message = decoders[kind].decode(payload.buffer)
                channels[kind].decoded(len(payload) + 1, time.perf_counter() - start)
                self.inputs.put((kind, message))
        except Exception as exc:  # a malformed message: a bug on the other side; give up loudly
            self.inputs.put(_Fatal(f"bad input message: {type(exc).__name__}: {exc}"))
        finally:
            self.input_sock.close(linger=0)

    def _output_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        telemetry = self.engine.telemetry
        channels = {CoreOutputKind.OUTPUTS: telemetry.channel("outputs"),
                    CoreOutputKind.UTILITY_RESULT: telemetry.channel("utility_results")}
        clock = time.perf_counter
        while (item := self.outputs.get()) is not None:
            kind, message = item
            start = clock()
            payload = encoder.encode(message)
            encoded = clock()
            channel = channels.get(kind)
            if channel is not None:  # counted before it is sent: the receiver never counts it first
                channel.encoded(len(payload) + 1, encoded - start)
            self.output_sock.send_multipart([bytes((kind,)), payload], copy=False)
            if kind == CoreOutputKind.OUTPUTS:
                telemetry.record("send_outputs", start, clock())

    def _send(self, kind: CoreOutputKind, message: msgspec.Struct) -> None:
        """Send from the calling thread (only before the output thread starts)."""
        self.output_sock.send_multipart([bytes((kind,)), msgspec.msgpack.encode(message)])

    def close(self) -> None:
        self._stop.set()
        if self._input.is_alive():
            self._input.join()
        elif self._input.ident is None:
            self.input_sock.close(linger=0)
        self.output_sock.close(linger=2000)  # ctx.term() delivers the last words before exiting


def main(argv: list[str]) -> int:
    init_child_process()
    launch = msgspec.json.decode(argv[1], type=CoreLaunch)
    die_with_parent(launch.parent_pid, launch.death_signal)
    logging.basicConfig(level=launch.log_level, format="%(asctime)s %(levelname)s core %(name)s: %(message)s")
    ctx = zmq.Context()
    proc = EngineCoreProc(launch, ctx)
    code = proc.run()
    proc.close()
    ctx.term()
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv))
