"""One worker per device: sets the device up and owns its model runner (or the null runner).

Also keeps the worker's telemetry: per-step phase timings, the device's idle time between
steps, and (debug mode) the check of its request mirror against the scheduler's digest.
"""

from __future__ import annotations

import os
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.protocol.digest import check_worker_view
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import GrammarBitmask, ProcessTelemetry, SchedulerOutput
from tokenmill.worker.device_idle import DeviceIdleMeter
from tokenmill.worker.device_profile import DeviceProfile
from tokenmill.worker.fault_injection import FaultInjector
from tokenmill.worker.model_runner import ModelRunner, PendingStep
from tokenmill.worker.null_runner import NullRunner, NullStep
from tokenmill.worker.pp_stage import PipelineStage
from tokenmill.worker.stage_probe import measure_for

_RUNNER_PHASES = ("prepare", "forward", "sample")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str = "",
                 device: torch.device | None = None, faults: FaultInjector | None = None) -> None:
        """`device`: this rank's (default: the config's); `dist_init_method`: where the ranks meet
        when there are several (blocks until all have joined); `faults`: test-only fault injection
        (worker/fault_injection.py)."""
        self.config = config
        parallel = config.parallel
        self.telemetry = Telemetry(f"worker{rank}", config.trace_steps, label=_rank_label(config, rank))
        null = config.model.load_format == "null"
        device = device or config.torch_device
        if device.type == "cuda" and not null and device.index is not None:
            torch.cuda.set_device(device)  # plain "cuda" keeps the current device
        torch.manual_seed(config.model.seed)
        if parallel.world_size > 1:
            probe = (lambda: measure_for(config, device)) if parallel.balance_stages and not null else None
            self.parallel = ParallelContext.init(config.model.arch, parallel, rank, dist_init_method, device, probe,
                                                 device_tokens=config.scheduler.pp_device_tokens)
        else:
            self.parallel = ParallelContext.single(config.model.arch)
        self.runner: ModelRunner | NullRunner = NullRunner(config) if null else ModelRunner(
            config, PipelineStage(self.parallel, self.telemetry), device)
        if faults is not None and isinstance(self.runner, ModelRunner):
            self.runner.faults = faults
        self._rank = rank
        self.idle = DeviceIdleMeter(torch.device("cpu") if null else device, self.telemetry)
        # Benchmarks only: a torch.profiler window over decode steps (TOKENMILL_DEVICE_PROFILE).
        self.profile = None if null else DeviceProfile.from_env(os.environ, rank, device)

    def load_model(self) -> None:
        self.runner.load_model()
        if self.runner.model is not None and getattr(self.runner, "faults", None) is not None:
            self.runner.faults.after_load(self.runner.model, self._rank)  # tests only: a planted wrong shard
        if self.runner.model is not None:
            self.idle.attach(self.runner.model)
            self.runner.on_device_work = self.idle.work_started  # CUDA graph replays skip the model's hooks

    def available_kv_blocks(self) -> int:
        return self.runner.available_kv_blocks()

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def weight_bytes(self) -> int:
        return getattr(self.runner, "weight_bytes", 0)  # the null runner holds no model

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingStep | NullStep:
        """Start a step without waiting for its sampled ids (async scheduling)."""
        start = time.perf_counter()
        self.idle.step_starting()
        step = self.runner.launch(scheduler_output)
        if self.telemetry.trace is not None:  # the step's device span, named (its rows set by launch)
            self.idle.name_step(_step_args(scheduler_output))
        self.idle.step_launched()
        if self.profile is not None:
            self.profile.after_launch(scheduler_output.batch_counts)
        self._record_phases(start, scheduler_output.step_id)
        check_worker_view(scheduler_output, self.runner.mirror_view)
        return step

    def finish_step(self, mask: GrammarBitmask) -> None:
        """Sample the launched step that waits for these grammar masks (structured outputs). The
        trace's `await_mask` span runs from the forward pass's launch to the mask's arrival; its
        `device_idle` says whether the device had finished the forward pass by then (it waited).
        On CUDA a `mask_idle` span (recorded a step or more later) lasts as long as the device
        sat idle between that forward pass and the mask (CUDA events)."""
        idle = self.runner.mask_idle() if hasattr(self.runner, "mask_idle") else None
        if idle is not None:  # an earlier step's exact device idle time (its events are done by now)
            now = time.perf_counter()
            self.telemetry.record("mask_idle", now - idle[1], now, {"step": idle[0]})
        self.runner.finish_step(mask)
        waited = getattr(self.runner, "last_mask_wait", None)
        if waited is not None:
            deferred_at, arrived, idle = waited
            self.telemetry.record("await_mask", deferred_at, arrived, {"step": mask.step_id, "device_idle": idle})
            seconds = self.runner.last_timings.get("sample")
            if seconds is not None:
                self.telemetry.record("sample_masked", arrived, arrived + seconds, {"step": mask.step_id})

    def _record_phases(self, start: float, step_id: int) -> None:
        """The runner's own phase timings (if it reports them), laid end to end from `start`."""
        timings = getattr(self.runner, "last_timings", None) or {}
        args = {"step": step_id}
        for name in _RUNNER_PHASES:
            seconds = timings.get(name)
            if seconds is not None:
                self.telemetry.record(name, start, start + seconds, args)
                start += seconds

    def held_requests(self) -> int:
        """How many requests this worker keeps state for (leak checks)."""
        return len(self.runner.states)

    def telemetry_snapshot(self) -> ProcessTelemetry:
        return self.telemetry.snapshot()

    def reset_telemetry(self) -> None:
        self.telemetry.reset()

    def shutdown(self) -> None:
        self.idle.flush(wait=True)  # the last steps' device spans into the trace
        self.telemetry.close()
        stage = getattr(self.runner, "stage", None)
        if stage is not None:
            stage.drain_tokens()  # no send left unmatched before the groups go
        self.parallel.destroy()


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of a local worker process: with several ranks on CUDA, one GPU each."""
    if config.device.startswith("cuda") and config.parallel.world_size > 1:
        return torch.device(f"cuda:{local_rank}")
    return config.torch_device


def _step_args(so: SchedulerOutput) -> dict:
    """A step's device span args: its id, rows, tokens and decode rows (one token each)."""
    counts = getattr(so, "batch_counts", None)
    if counts is None:
        return {"step": so.step_id}
    args = {"step": so.step_id, "rows": len(counts), "tokens": int(counts.sum()),
            "decode_rows": int((counts == 1).sum())}
    if so.pp_tokens_upto:  # pipeline device tokens: the first stage waits for these steps' tokens
        args["tokens_upto"] = so.pp_tokens_upto
    return args


def _rank_label(config: EngineConfig, rank: int) -> str:
    """The trace track's name: the rank's stage and TP index when the model is split."""
    parallel = config.parallel
    if parallel.world_size == 1:
        return f"worker{rank}"
    tp = parallel.tensor_parallel_size
    return f"worker{rank}: pp stage {rank // tp}, tp rank {rank % tp}"
