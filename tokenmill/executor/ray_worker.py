"""One rank as a Ray actor (`RayExecutor` makes it one with `ray.remote`; this module imports no ray).

It receives exactly what a local worker process reads from the ring: the msgspec-encoded bytes
of `SchedulerOutput` and `WorkerCall`, and answers with msgspec-encoded `ModelRunnerOutput` (the
driver only) and `WorkerCallResult`; Ray carries opaque bytes, nothing of ours is pickled.
Ray runs one actor's calls one at a time, in the order the engine core made them, so each rank
sees the steps in order, as from the ring. A step that waits for its grammar masks (structured
outputs) is launched by `execute`, which then answers nothing; `finish` brings the masks, samples
and answers the step's output.
"""

from __future__ import annotations

import logging
import socket
import time

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.protocol import GrammarBitmask, SchedulerOutput, WorkerCall, WorkerCallResult

logger = logging.getLogger(__name__)

_CALLS = ("load_model", "available_kv_blocks", "kv_block_bytes", "weight_bytes", "init_kv_cache",
          "telemetry_snapshot", "reset_telemetry", "held_requests")


class RayWorker:
    def __init__(self, config_json: bytes, rank: int, log_level: int) -> None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s worker{rank} %(name)s: %(message)s")
        self.config = msgspec.json.decode(config_json, type=EngineConfig)
        self.rank = rank
        self.driver = rank == self.config.parallel.driver_rank
        self.worker = None
        self._steps = msgspec.msgpack.Decoder(SchedulerOutput)
        self._calls = msgspec.msgpack.Decoder(WorkerCall)
        self._encoder = msgspec.msgpack.Encoder()
        self._masks = msgspec.msgpack.Decoder(GrammarBitmask)
        self._awaiting = None  # the launched step waiting for its grammar masks

    def node(self) -> tuple[str, str]:
        """(node id, node IP) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, dist_init_method: str) -> None:
        """Join the other ranks (every actor's `start` must be running at once) and set up."""
        import torch

        from tokenmill.worker.worker import Worker
        device = torch.device("cuda:0") if self.config.device.startswith("cuda") else torch.device("cpu")
        self.worker = Worker(self.config, self.rank, dist_init_method, device)  # Ray picks the GPU

    def call(self, message: bytes) -> bytes:
        call = self._calls.decode(message)
        if call.method not in _CALLS:
            raise ValueError(f"unknown worker call {call.method!r}")
        method = getattr(self.worker, call.method)
        value = method() if call.arg is None else method(call.arg)
        return self._encoder.encode(WorkerCallResult(value))

    def execute(self, message: bytes) -> bytes:
        """Run one step; the driver returns its output, the other ranks b""."""
        telemetry, clock = self.worker.telemetry, time.perf_counter
        start = clock()
        so = self._steps.decode(message)
        decoded = clock()
        telemetry.channel("steps").decoded(len(message), decoded - start)
        telemetry.record("decode", start, decoded, {"step": so.step_id})
        step = self.worker.launch_model(so)
        if so.awaits_bitmask:  # sampling waits for the masks: `finish` answers for the step
            self._awaiting = step
            return b""
        return self._reply(step.output())

    def finish(self, message: bytes) -> bytes:
        """The grammar masks of the step `execute` left waiting: sample it and answer its output."""
        step, self._awaiting = self._awaiting, None
        assert step is not None, "grammar masks for no step"
        self.worker.finish_step(self._masks.decode(message))
        return self._reply(step.output())

    def _reply(self, output) -> bytes:
        if not self.driver:
            return b""
        telemetry, clock = self.worker.telemetry, time.perf_counter
        read = clock()
        payload = self._encoder.encode(output)
        telemetry.channel("results").encoded(len(payload), clock() - read)
        return payload

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
