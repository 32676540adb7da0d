"""An executor runs steps on the workers: `submit(batch) -> future`, results collected later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.metrics.message_stats import MessageStats
from tokenmill.protocol import GrammarBitmask, ModelRunnerOutput, ProcessTelemetry, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def available_kv_blocks(self) -> int:
        """The smallest KV pool any worker can hold."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def kv_block_bytes(self) -> int: ...

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start a step; the future resolves to the driver worker's output."""

    def send_bitmask(self, mask: GrammarBitmask) -> None:
        """The grammar masks a submitted step waits for (structured outputs; see core/grammar_masks.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not support structured outputs")

    def channel_stats(self) -> dict[str, MessageStats]:
        """This (the engine core's) side of the worker channels; shared, reset in place."""
        return {}

    def worker_telemetry(self) -> list[ProcessTelemetry]:
        """Each worker's telemetry, by rank."""
        return []

    def reset_worker_telemetry(self) -> None:
        pass

    def held_requests(self) -> list[int]:
        """How many requests each worker keeps state for, by rank (leak checks)."""
        return []

    def shutdown(self) -> None:
        pass
