"""Workers in their own processes (`WorkerGroup`): the Executor interface over the ring.

The engine-core process starts the group before it imports torch (both take seconds of
imports), then hands it over: `MultiprocExecutor(config, workers=group)`. Setup calls go
through the same channel as steps, as typed `WorkerCall`s.
"""

from __future__ import annotations

from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.executor.worker_group import WorkerGroup
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.protocol import GrammarBitmask, ModelRunnerOutput, ProcessTelemetry, SchedulerOutput


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, *, workers: WorkerGroup) -> None:
        super().__init__(config)
        self.workers = workers
        try:
            workers.wait_ready()
            workers.call("load_model")
        except BaseException:
            workers.shutdown()
            raise

    def available_kv_blocks(self) -> int:
        return min(self.workers.call("available_kv_blocks"))

    def kv_block_bytes(self) -> int:
        return self.workers.call("kv_block_bytes")[0]

    def init_kv_cache(self, num_blocks: int) -> None:
        self.workers.call("init_kv_cache", num_blocks)

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return self.workers.submit(scheduler_output)

    def send_bitmask(self, mask: GrammarBitmask) -> None:
        self.workers.send_bitmask(mask)

    def channel_stats(self) -> dict[str, MessageStats]:
        return self.workers.channels

    def worker_telemetry(self) -> list[ProcessTelemetry]:
        return self.workers.call("telemetry_snapshot")

    def reset_worker_telemetry(self) -> None:
        self.workers.call("reset_telemetry")

    def held_requests(self) -> list[int]:
        return self.workers.call("held_requests")

    def shutdown(self) -> None:
        self.workers.shutdown()
