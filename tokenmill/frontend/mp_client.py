"""Clients of an engine core in its own process (`CoreProcess`), over ZMQ.

`MPClientBase` holds all they share: sending (requests, aborts, utility calls), filing each
frame the core sends (OUTPUTS queue up, a UTILITY_RESULT goes to its caller, an ERROR ends
the engine) and the liveness checks. `MPClient` and `AsyncMPClient` only wait for frames,
blocking or awaiting; sends never block (the input socket has no high-water mark).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections import deque

import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.client_codec import ClientCodec, utility_value
from tokenmill.frontend.core_client import AsyncEngineCoreClient, CoreClient, EngineCoreClient
from tokenmill.frontend.core_process import CoreProcess
from tokenmill.protocol import (AbortRequests, CoreInputKind, CoreOutputKind, EngineCoreOutputs, EngineCoreRequest,
                                UtilityResult)
from tokenmill.transport.channels import LAST_WORDS_S, POLL_MS

_LAST_WORDS_MS = int(LAST_WORDS_S * 1000)


class MPClientBase(CoreClient):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config.trace_steps, config.parallel.world_size)
        self.core = CoreProcess(config)
        self._codec = ClientCodec(self.telemetry)
        self._outputs: deque[EngineCoreOutputs] = deque()  # filed, not yet taken by get_outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.core.send(CoreInputKind.ADD, self._codec.request(request))

    def abort_requests(self, handles: list[int]) -> None:
        if handles and not self.core.failed and not self.core.closed:
            self.core.send(CoreInputKind.ABORT, self._codec.request(AbortRequests(handles)))

    def _send_call(self, method: str) -> int:
        """Send utility call `method`; its call id (the result comes back as a frame)."""
        self._check_alive()
        call_id, payload = self._codec.utility_call(method)
        self.core.send(CoreInputKind.UTILITY, payload)
        return call_id

    def _file(self, frames) -> None:
        """One frame from the core, filed where its reader will look; raises on the core's last words."""
        kind_frame, payload = frames
        kind = kind_frame.bytes[0]
        if kind == CoreOutputKind.OUTPUTS:
            self._outputs.append(self._codec.outputs(payload))
        elif kind == CoreOutputKind.UTILITY_RESULT:
            self._deliver(self._codec.utility_result(payload))
        elif kind == CoreOutputKind.ERROR:
            raise self.core.dead_error(self.core.decode_error(payload.buffer))

    @abstractmethod
    def _deliver(self, result: UtilityResult) -> None:
        """Hand a utility result to the caller waiting for it."""

    def _core_gone_quiet(self) -> bool:
        """After a poll interval without a frame: raises once the engine was shut down; True when
        the core process has exited (the reader then waits for its last words, and raises
        `core.dead_error()` if none come)."""
        if self.core.closed:
            raise EngineDeadError("the engine was shut down")
        return self.core.dead.is_set()

    def _check_alive(self) -> None:
        if self.core.closed:
            raise EngineDeadError("the engine was shut down")
        if self.core.failed:
            raise self.core.dead_error()

    def _stop_core(self) -> None:
        self.core.close()

    def kill_core(self) -> None:
        self.core.kill()


class MPClient(MPClientBase, EngineCoreClient):
    """Whichever call is waiting reads the socket and files what it meets."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._results: dict[int, UtilityResult] = {}

    def get_outputs(self) -> EngineCoreOutputs:
        while not self._outputs:
            self._file(self._next_frame())
        return self._outputs.popleft()

    def outputs_ready(self) -> bool:
        return bool(self._outputs) or bool(self.core.output.poll(0))

    def call(self, method: str):
        call_id = self._send_call(method)
        while call_id not in self._results:
            self._file(self._next_frame())
        return utility_value(self._results.pop(call_id))

    def _deliver(self, result: UtilityResult) -> None:
        self._results[result.call_id] = result

    def _next_frame(self):
        sock = self.core.output
        while not sock.poll(POLL_MS):
            if self._core_gone_quiet() and not sock.poll(_LAST_WORDS_MS):
                raise self.core.dead_error()
        return sock.recv_multipart(copy=False)


class AsyncMPClient(MPClientBase, AsyncEngineCoreClient):
    """Only `get_outputs` reads (through a zmq.asyncio shadow of the output socket), so a utility
    call is answered only while a task runs it (AsyncLLM's output handler); the results it
    meets resolve the futures their callers await."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._output = zmq.asyncio.Socket.shadow(self.core.output.underlying)
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}

    async def get_outputs(self) -> EngineCoreOutputs:
        try:
            while not self._outputs:
                self._file(await self._next_frame())
        except EngineDeadError as exc:
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(exc)
            self._calls.clear()
            raise
        return self._outputs.popleft()

    async def call(self, method: str):
        future = asyncio.get_running_loop().create_future()
        self._calls[self._send_call(method)] = future
        return utility_value(await future)

    def _deliver(self, result: UtilityResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def _next_frame(self):
        while not await self._output.poll(POLL_MS):
            if self._core_gone_quiet() and not await self._output.poll(_LAST_WORDS_MS):
                raise self.core.dead_error()
        return await self._output.recv_multipart(copy=False)
