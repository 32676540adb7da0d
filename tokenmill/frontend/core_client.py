"""How the front-end talks to the engine core: what every client shares, and the two ways to wait.

`CoreClient` is what all clients share, whether the core runs in this process
(`inproc_client`) or its own (`mp_client`): the front-end's `Telemetry` (and, on shutdown,
merging the step trace), and the calls that never wait: `add_request`, `abort_requests`.
`EngineCoreClient` (for `LLM`) and `AsyncEngineCoreClient` (for `AsyncLLM`) differ only in
how they wait for the core:
- `get_outputs()` waits for the next non-empty batch of outputs, raising `EngineDeadError`
  once the core is gone;
- `call(method)` is a utility call answered between steps (an `EngineCore` method without
  arguments that the core process allows); the typed `kv_cache_stats()`,
  `scheduler_stats()`, `telemetry_report()` and `reset_telemetry()` are built on it, the
  report adding the front-end's own telemetry first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.metrics.step_trace import merge_parts, remove_stale_parts
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import EngineCoreOutputs, EngineCoreRequest, KVCacheStats, SchedulerStats, TelemetryReport


class CoreClient(ABC):
    def __init__(self, trace_path: str | None, world_size: int) -> None:
        """`world_size`: worker processes writing a trace part (one per rank)."""
        self._trace_roles = ["frontend", "core", *(f"worker{rank}" for rank in range(world_size))]
        if trace_path:
            remove_stale_parts(trace_path, self._trace_roles)
        self.telemetry = Telemetry("frontend", trace_path)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Never waits; raises EngineDeadError once the core is gone."""

    @abstractmethod
    def abort_requests(self, handles: list[int]) -> None:
        """Never waits; does nothing once the core is gone."""

    def shutdown(self) -> None:
        """Stop the core (idempotent), then write the front-end's trace part and merge every part."""
        self._stop_core()
        if self.telemetry.trace is not None:
            self.telemetry.close()
            merge_parts(self.telemetry.trace.path, self._trace_roles)
            self.telemetry.trace = None

    @abstractmethod
    def _stop_core(self) -> None: ...

    def kill_core(self) -> None:
        """Stop a core that no longer answers, at once (in-process: nothing to kill)."""

    def _with_frontend(self, report: TelemetryReport) -> TelemetryReport:
        return TelemetryReport([self.telemetry.snapshot(), *report.processes], report.speculation)


class EngineCoreClient(CoreClient):
    """Waits by blocking the calling thread."""

    @abstractmethod
    def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call(self, method: str):
        """Run utility `method` in the core between steps; its return value."""

    def outputs_ready(self) -> bool:
        """Whether outputs are already waiting (so `get_outputs` would not wait for a step)."""
        return False

    def drain(self) -> None:
        """After an interrupted run: let the core settle (in-process: finish in-flight steps)."""

    def kv_cache_stats(self) -> KVCacheStats:
        return self.call("kv_cache_stats")

    def scheduler_stats(self) -> SchedulerStats:
        return self.call("scheduler_stats")

    def telemetry_report(self) -> TelemetryReport:
        """Every process's telemetry: the front-end, the core, then each worker."""
        return self._with_frontend(self.call("telemetry_report"))

    def reset_telemetry(self) -> None:
        self.call("reset_telemetry")
        self.telemetry.reset()


class AsyncEngineCoreClient(CoreClient):
    """Waits by awaiting, on the event loop's thread."""

    @abstractmethod
    async def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def call(self, method: str):
        """Run utility `method` in the core between steps; its return value."""

    async def kv_cache_stats(self) -> KVCacheStats:
        return await self.call("kv_cache_stats")

    async def scheduler_stats(self) -> SchedulerStats:
        return await self.call("scheduler_stats")

    async def telemetry_report(self) -> TelemetryReport:
        return self._with_frontend(await self.call("telemetry_report"))

    async def reset_telemetry(self) -> None:
        await self.call("reset_telemetry")
        self.telemetry.reset()
