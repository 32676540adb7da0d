"""An executor runs steps on the workers: `submit(batch) -> future`, results collected later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.protocol import ModelRunnerOutput, SchedulerOutput


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

    def shutdown(self) -> None:
        pass
