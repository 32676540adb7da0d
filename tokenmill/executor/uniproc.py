"""The worker lives in the engine core's own process: no sockets, for tests and debugging."""

from __future__ import annotations

from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.protocol import GrammarBitmask, ModelRunnerOutput, ProcessTelemetry, SchedulerOutput
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

    def worker_telemetry(self) -> list[ProcessTelemetry]:
        return [self.worker.telemetry_snapshot()]

    def reset_worker_telemetry(self) -> None:
        self.worker.reset_telemetry()

    def held_requests(self) -> list[int]:
        return [self.worker.held_requests()]

    def shutdown(self) -> None:
        self.worker.shutdown()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Launch now; the future reads the sampled ids back when asked, so the caller can
        launch the next step first (async scheduling)."""
        try:
            step = self.worker.launch_model(scheduler_output)
        except BaseException as exc:  # delivered to whoever waits on the step
            future: Future[ModelRunnerOutput] = Future()
            future.set_exception(exc)
            return future
        return _StepFuture(step)


    def send_bitmask(self, mask: GrammarBitmask) -> None:
        self.worker.finish_step(mask)


class _StepFuture(Future):
    def __init__(self, step) -> None:
        super().__init__()
        self._step = step

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                self.set_result(self._step.output())
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)
