"""The worker lives in the engine core's own process: no sockets, for tests and debugging."""

from __future__ import annotations

from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.protocol import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.worker.execute_model(scheduler_output))
        except BaseException as exc:  # delivered to whoever waits on the step
            future.set_exception(exc)
        return future
