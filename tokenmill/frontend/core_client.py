"""How the front-end talks to the engine core: in-process, or over ZMQ to its own process.

`EngineCoreClient` (sync, for `LLM`) and `AsyncEngineCoreClient` (asyncio, for `AsyncLLM`):
- `add_request` / `abort_requests` never block;
- `get_outputs()` waits for the next non-empty batch of outputs, raising `EngineDeadError`
  once the core is gone;
- `kv_cache_stats()` / `scheduler_stats()` / `telemetry_report()` / `reset_telemetry()` are
  utility calls answered between steps; the report adds the front-end's own telemetry.
The in-process clients run the same `EngineCore` with no sockets (`single_process=True`).
Each client owns the front-end's `Telemetry` and, on shutdown, merges the step trace.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.core_process import CoreProcess
from tokenmill.metrics.step_trace import merge_parts, remove_stale_parts
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import (AbortRequests, CoreInputKind, CoreOutputKind, EngineCoreOutputs, EngineCoreRequest,
                                KVCacheStats, SchedulerStats, TelemetryReport, UtilityCall, UtilityResult)
from tokenmill.transport.channels import LAST_WORDS_S, POLL_MS

_LAST_WORDS_MS = int(LAST_WORDS_S * 1000)


def _trace_roles(world_size: int) -> list[str]:
    return ["frontend", "core", *(f"worker{rank}" for rank in range(world_size))]


def _start_telemetry(config: EngineConfig, world_size: int) -> Telemetry:
    if config.trace_steps:
        remove_stale_parts(config.trace_steps, _trace_roles(world_size))
    return Telemetry("frontend", config.trace_steps)


def _finish_telemetry(telemetry: Telemetry, world_size: int) -> None:
    """After the engine has stopped: write the front-end's trace part and merge every part."""
    if telemetry.trace is not None:
        telemetry.close()
        merge_parts(telemetry.trace.path, _trace_roles(world_size))
        telemetry.trace = None


def _with_frontend(report: TelemetryReport, telemetry: Telemetry) -> TelemetryReport:
    return TelemetryReport([telemetry.snapshot(), *report.processes])


class EngineCoreClient(ABC):
    telemetry: Telemetry

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, handles: list[int]) -> None: ...

    @abstractmethod
    def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def kv_cache_stats(self) -> KVCacheStats: ...

    @abstractmethod
    def scheduler_stats(self) -> SchedulerStats: ...

    def outputs_ready(self) -> bool:
        """Whether outputs are already waiting (so `get_outputs` would not wait for a step)."""
        return False

    @abstractmethod
    def telemetry_report(self) -> TelemetryReport:
        """Every process's telemetry: the front-end, the core, then each worker."""

    @abstractmethod
    def reset_telemetry(self) -> None: ...

    def drain(self) -> None:
        """After an interrupted run: let the core settle (in-process: finish in-flight steps)."""

    @abstractmethod
    def shutdown(self) -> None: ...


def make_client(config: EngineConfig, single_process: bool) -> EngineCoreClient:
    return InprocClient(config) if single_process else MPClient(config)


def make_async_client(config: EngineConfig, single_process: bool) -> AsyncEngineCoreClient:
    return AsyncInprocClient(config) if single_process else AsyncMPClient(config)


# ---------------------------------------------------------------------------- in-process


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.core.engine_core import EngineCore
        self.telemetry = _start_telemetry(config, 1)
        self.engine = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, handles: list[int]) -> None:
        self.engine.abort_requests(handles)

    def get_outputs(self) -> EngineCoreOutputs:
        return self.engine.step()

    def kv_cache_stats(self) -> KVCacheStats:
        return self.engine.kv_cache_stats()

    def scheduler_stats(self) -> SchedulerStats:
        return self.engine.scheduler_stats()

    def telemetry_report(self) -> TelemetryReport:
        return _with_frontend(self.engine.telemetry_report(), self.telemetry)

    def reset_telemetry(self) -> None:
        self.telemetry.reset()
        self.engine.reset_telemetry()

    def drain(self) -> None:
        while self.engine.in_flight:
            self.engine.step()

    def shutdown(self) -> None:
        self.engine.shutdown()
        _finish_telemetry(self.telemetry, 1)


# ---------------------------------------------------------------------------- multi-process


class _Codec:
    """The front-end's encoders and decoders, one per message type; each message is counted
    in the front-end's telemetry (size with the kind byte, encode or decode time)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility = msgspec.msgpack.Decoder(UtilityResult)
        self._call_ids = itertools.count()
        self._requests = telemetry.channel("requests")
        self._outputs_stats = telemetry.channel("outputs")
        self._calls_stats = telemetry.channel("utility_calls")
        self._results_stats = telemetry.channel("utility_results")

    def request(self, message: EngineCoreRequest | AbortRequests) -> bytes:
        start = time.perf_counter()
        payload = self._encoder.encode(message)
        self._requests.encoded(len(payload) + 1, time.perf_counter() - start)
        return payload

    def utility_call(self, method: str) -> tuple[int, bytes]:
        call_id = next(self._call_ids)
        start = time.perf_counter()
        payload = self._encoder.encode(UtilityCall(call_id, method))
        self._calls_stats.encoded(len(payload) + 1, time.perf_counter() - start)
        return call_id, payload

    def outputs(self, payload) -> EngineCoreOutputs:
        start = time.perf_counter()
        outputs = self._outputs.decode(payload.buffer)
        self._outputs_stats.decoded(len(payload) + 1, time.perf_counter() - start)
        return outputs

    def utility_result(self, payload) -> UtilityResult:
        start = time.perf_counter()
        result = self._utility.decode(payload.buffer)
        self._results_stats.decoded(len(payload) + 1, time.perf_counter() - start)
        return result


def _utility_value(result: UtilityResult):
    if result.error is not None:
        raise RuntimeError(f"engine core utility call failed: {result.error}")
    return result.result


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self._world_size = config.parallel.world_size
        self.telemetry = _start_telemetry(config, self._world_size)
        self.core = CoreProcess(config)
        self._codec = _Codec(self.telemetry)
        self._outputs: deque[EngineCoreOutputs] = deque()  # arrived while waiting for a utility result
        self._results: dict[int, UtilityResult] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.core.send(CoreInputKind.ADD, self._codec.request(request))

    def abort_requests(self, handles: list[int]) -> None:
        if handles and not self.core.failed and not self.core.closed:
            self.core.send(CoreInputKind.ABORT, self._codec.request(AbortRequests(handles)))

    def get_outputs(self) -> EngineCoreOutputs:
        while not self._outputs:
            self._receive()
        return self._outputs.popleft()

    def outputs_ready(self) -> bool:
        return bool(self._outputs) or bool(self.core.output.poll(0))

    def kv_cache_stats(self) -> KVCacheStats:
        return self._utility("kv_cache_stats")

    def scheduler_stats(self) -> SchedulerStats:
        return self._utility("scheduler_stats")

    def telemetry_report(self) -> TelemetryReport:
        return _with_frontend(self._utility("telemetry_report"), self.telemetry)

    def reset_telemetry(self) -> None:
        self._utility("reset_telemetry")
        self.telemetry.reset()

    def _utility(self, method: str):
        self._check_alive()
        call_id, payload = self._codec.utility_call(method)
        self.core.send(CoreInputKind.UTILITY, payload)
        while call_id not in self._results:
            self._receive()
        return _utility_value(self._results.pop(call_id))

    def _receive(self) -> None:
        """Wait for one message and file it; raise EngineDeadError once the core is gone."""
        sock = self.core.output
        while not sock.poll(POLL_MS):
            if self.core.closed:
                raise EngineDeadError("the engine was shut down")
            if self.core.dead.is_set() and not sock.poll(_LAST_WORDS_MS):
                raise self.core.dead_error()
        kind, payload = sock.recv_multipart(copy=False)
        kind = kind.bytes[0]
        if kind == CoreOutputKind.OUTPUTS:
            self._outputs.append(self._codec.outputs(payload))
        elif kind == CoreOutputKind.UTILITY_RESULT:
            result = self._codec.utility_result(payload)
            self._results[result.call_id] = result
        elif kind == CoreOutputKind.ERROR:
            raise self.core.dead_error(self.core.decode_error(payload.buffer))

    def _check_alive(self) -> None:
        if self.core.closed:
            raise EngineDeadError("the engine was shut down")
        if self.core.failed:
            raise self.core.dead_error()

    def shutdown(self) -> None:
        self.core.close()
        _finish_telemetry(self.telemetry, self._world_size)


# ---------------------------------------------------------------------------- asyncio


class AsyncEngineCoreClient(ABC):
    telemetry: Telemetry

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, handles: list[int]) -> None: ...

    @abstractmethod
    async def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def kv_cache_stats(self) -> KVCacheStats: ...

    @abstractmethod
    async def scheduler_stats(self) -> SchedulerStats: ...

    @abstractmethod
    async def telemetry_report(self) -> TelemetryReport: ...

    @abstractmethod
    async def reset_telemetry(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncInprocClient(AsyncEngineCoreClient):
    """Steps run on the event loop's thread (blocking it for a forward pass): debugging only."""

    def __init__(self, config: EngineConfig) -> None:
        self._sync = InprocClient(config)
        self.telemetry = self._sync.telemetry
        self._work = asyncio.Event()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._sync.add_request(request)
        self._work.set()

    def abort_requests(self, handles: list[int]) -> None:
        self._sync.abort_requests(handles)

    async def get_outputs(self) -> EngineCoreOutputs:
        while True:
            while not self._sync.engine.has_work():
                self._work.clear()
                await self._work.wait()
            await asyncio.sleep(0)  # let consumers run between steps
            outputs = self._sync.get_outputs()
            if not outputs.is_empty():
                return outputs

    async def kv_cache_stats(self) -> KVCacheStats:
        return self._sync.kv_cache_stats()

    async def scheduler_stats(self) -> SchedulerStats:
        return self._sync.scheduler_stats()

    async def telemetry_report(self) -> TelemetryReport:
        return self._sync.telemetry_report()

    async def reset_telemetry(self) -> None:
        self._sync.reset_telemetry()

    def shutdown(self) -> None:
        self._sync.shutdown()


class AsyncMPClient(AsyncEngineCoreClient):
    """Sends go straight to the (never-blocking) sync socket; receiving is awaited through a
    zmq.asyncio shadow of the output socket. Only `get_outputs` reads: utility results it
    meets are handed to the futures their callers await."""

    def __init__(self, config: EngineConfig) -> None:
        self._world_size = config.parallel.world_size
        self.telemetry = _start_telemetry(config, self._world_size)
        self.core = CoreProcess(config)
        self._codec = _Codec(self.telemetry)
        self._output = zmq.asyncio.Socket.shadow(self.core.output.underlying)
        self._calls: dict[int, asyncio.Future] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.core.send(CoreInputKind.ADD, self._codec.request(request))

    def abort_requests(self, handles: list[int]) -> None:
        if handles and not self.core.failed and not self.core.closed:
            self.core.send(CoreInputKind.ABORT, self._codec.request(AbortRequests(handles)))

    async def get_outputs(self) -> EngineCoreOutputs:
        try:
            while True:
                while not await self._output.poll(POLL_MS):
                    if self.core.closed:
                        raise EngineDeadError("the engine was shut down")
                    if self.core.dead.is_set() and not await self._output.poll(_LAST_WORDS_MS):
                        raise self.core.dead_error()
                kind, payload = await self._output.recv_multipart(copy=False)
                kind = kind.bytes[0]
                if kind == CoreOutputKind.OUTPUTS:
                    return self._codec.outputs(payload)
                if kind == CoreOutputKind.UTILITY_RESULT:
                    result = self._codec.utility_result(payload)
                    future = self._calls.pop(result.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
                elif kind == CoreOutputKind.ERROR:
                    raise self.core.dead_error(self.core.decode_error(payload.buffer))
        except EngineDeadError as exc:
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(exc)
            self._calls.clear()
            raise

    async def kv_cache_stats(self) -> KVCacheStats:
        return await self._utility("kv_cache_stats")

    async def scheduler_stats(self) -> SchedulerStats:
        return await self._utility("scheduler_stats")

    async def telemetry_report(self) -> TelemetryReport:
        return _with_frontend(await self._utility("telemetry_report"), self.telemetry)

    async def reset_telemetry(self) -> None:
        await self._utility("reset_telemetry")
        self.telemetry.reset()

    async def _utility(self, method: str):
        """Needs a task running `get_outputs` (AsyncLLM's output handler) to be answered."""
        self._check_alive()
        call_id, payload = self._codec.utility_call(method)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.core.send(CoreInputKind.UTILITY, payload)
        return _utility_value(await future)

    def _check_alive(self) -> None:
        if self.core.closed:
            raise EngineDeadError("the engine was shut down")
        if self.core.failed:
            raise self.core.dead_error()

    def shutdown(self) -> None:
        self.core.close()
        _finish_telemetry(self.telemetry, self._world_size)
