"""One worker per device: sets the device up and owns its model runner."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.protocol import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner, PendingStep


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = config.device.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config)

    def load_model(self) -> None:
        self.runner.load_model()

    def available_kv_blocks(self) -> int:
        return self.runner.available_kv_blocks()

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step without waiting for its sampled ids (async scheduling)."""
        return self.runner.launch(scheduler_output)
