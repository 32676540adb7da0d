"""How the front-end talks to the engine core: in-process, or over ZMQ to its own process.

`EngineCoreClient` (sync, for `LLM`) and `AsyncEngineCoreClient` (asyncio, for `AsyncLLM`):
- `add_request` / `abort_requests` never block;
- `get_outputs()` waits for the next non-empty batch of outputs, raising `EngineDeadError`
  once the core is gone;
- `kv_cache_stats()` / `scheduler_stats()` are utility calls answered between steps.
The in-process clients run the same `EngineCore` with no sockets (`single_process=True`).
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.core_process import CoreProcess
from tokenmill.protocol import (AbortRequests, CoreInputKind, CoreOutputKind, EngineCoreOutputs, EngineCoreRequest,
                                KVCacheStats, SchedulerStatsReport, UtilityCall, UtilityResult)

_POLL_MS = 100
_LAST_WORDS_MS = 300  # after the core exits, how long its ErrorReport may still take to arrive


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, handles: list[int]) -> None: ...

    @abstractmethod
    def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def kv_cache_stats(self) -> KVCacheStats: ...

    @abstractmethod
    def scheduler_stats(self) -> SchedulerStatsReport: ...

    def drain(self) -> None:
        """After an interrupted run: let the core settle (in-process: finish in-flight steps)."""

    @abstractmethod
    def shutdown(self) -> None: ...


def make_client(engine_args: EngineArgs, config: EngineConfig) -> EngineCoreClient:
    return InprocClient(config) if engine_args.single_process else MPClient(engine_args, config)


def make_async_client(engine_args: EngineArgs, config: EngineConfig) -> AsyncEngineCoreClient:
    return AsyncInprocClient(config) if engine_args.single_process else AsyncMPClient(engine_args, config)


# ---------------------------------------------------------------------------- in-process


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.core.engine_core import EngineCore
        self.engine = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, handles: list[int]) -> None:
        self.engine.abort_requests(handles)

    def get_outputs(self) -> EngineCoreOutputs:
        return self.engine.step()

    def kv_cache_stats(self) -> KVCacheStats:
        return self.engine.kv_cache_stats()

    def scheduler_stats(self) -> SchedulerStatsReport:
        return self.engine.scheduler_stats()

    def drain(self) -> None:
        while self.engine.in_flight:
            self.engine.step()

    def shutdown(self) -> None:
        self.engine.shutdown()


# ---------------------------------------------------------------------------- multi-process


class _Codec:
    """The front-end's encoders and decoders, one per message type."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.utility = msgspec.msgpack.Decoder(UtilityResult)
        self._call_ids = itertools.count()

    def utility_call(self, method: str) -> tuple[int, bytes]:
        call_id = next(self._call_ids)
        return call_id, self.encoder.encode(UtilityCall(call_id, method))


def _utility_value(result: UtilityResult):
    if result.error is not None:
        raise RuntimeError(f"engine core utility call failed: {result.error}")
    return result.result


class MPClient(EngineCoreClient):
    def __init__(self, engine_args: EngineArgs, config: EngineConfig) -> None:
        self.core = CoreProcess(engine_args, config)
        self._codec = _Codec()
        self._outputs: deque[EngineCoreOutputs] = deque()  # arrived while waiting for a utility result
        self._results: dict[int, UtilityResult] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.core.send(CoreInputKind.ADD, self._codec.encoder.encode(request))

    def abort_requests(self, handles: list[int]) -> None:
        if handles and not self.core.failed and not self.core.closed:
            self.core.send(CoreInputKind.ABORT, self._codec.encoder.encode(AbortRequests(handles)))

    def get_outputs(self) -> EngineCoreOutputs:
        while not self._outputs:
            self._receive()
        return self._outputs.popleft()

    def kv_cache_stats(self) -> KVCacheStats:
        return self._utility("kv_cache_stats")

    def scheduler_stats(self) -> SchedulerStatsReport:
        return self._utility("scheduler_stats")

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
        while not sock.poll(_POLL_MS):
            if self.core.closed:
                raise EngineDeadError("the engine was shut down")
            if self.core.dead.is_set() and not sock.poll(_LAST_WORDS_MS):
                raise self.core.dead_error()
        kind, payload = sock.recv_multipart(copy=False)
        kind = kind.bytes[0]
        if kind == CoreOutputKind.OUTPUTS:
            self._outputs.append(self._codec.outputs.decode(payload.buffer))
        elif kind == CoreOutputKind.UTILITY_RESULT:
            result = self._codec.utility.decode(payload.buffer)
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


# ---------------------------------------------------------------------------- asyncio


class AsyncEngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, handles: list[int]) -> None: ...

    @abstractmethod
    async def get_outputs(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def kv_cache_stats(self) -> KVCacheStats: ...

    @abstractmethod
    async def scheduler_stats(self) -> SchedulerStatsReport: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncInprocClient(AsyncEngineCoreClient):
    """Steps run on the event loop's thread (blocking it for a forward pass): debugging only."""

    def __init__(self, config: EngineConfig) -> None:
        self._sync = InprocClient(config)
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
            if outputs.outputs:
                return outputs

    async def kv_cache_stats(self) -> KVCacheStats:
        return self._sync.kv_cache_stats()

    async def scheduler_stats(self) -> SchedulerStatsReport:
        return self._sync.scheduler_stats()

    def shutdown(self) -> None:
        self._sync.shutdown()


class AsyncMPClient(AsyncEngineCoreClient):
    """Sends go straight to the (never-blocking) sync socket; receiving is awaited through a
    zmq.asyncio shadow of the output socket. Only `get_outputs` reads: utility results it
    meets are handed to the futures their callers await."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig) -> None:
        self.core = CoreProcess(engine_args, config)
        self._codec = _Codec()
        self._output = zmq.asyncio.Socket.shadow(self.core.output.underlying)
        self._calls: dict[int, asyncio.Future] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.core.send(CoreInputKind.ADD, self._codec.encoder.encode(request))

    def abort_requests(self, handles: list[int]) -> None:
        if handles and not self.core.failed and not self.core.closed:
            self.core.send(CoreInputKind.ABORT, self._codec.encoder.encode(AbortRequests(handles)))

    async def get_outputs(self) -> EngineCoreOutputs:
        try:
            while True:
                while not await self._output.poll(_POLL_MS):
                    if self.core.closed:
                        raise EngineDeadError("the engine was shut down")
                    if self.core.dead.is_set() and not await self._output.poll(_LAST_WORDS_MS):
                        raise self.core.dead_error()
                kind, payload = await self._output.recv_multipart(copy=False)
                kind = kind.bytes[0]
                if kind == CoreOutputKind.OUTPUTS:
                    return self._codec.outputs.decode(payload.buffer)
                if kind == CoreOutputKind.UTILITY_RESULT:
                    result = self._codec.utility.decode(payload.buffer)
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

    async def scheduler_stats(self) -> SchedulerStatsReport:
        return await self._utility("scheduler_stats")

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
