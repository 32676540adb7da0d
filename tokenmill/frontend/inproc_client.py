"""Clients of an engine core in this process (`single_process=True`): the same `EngineCore`,
no sockets, each step run by whoever waits for outputs. For tests and debugging."""

from __future__ import annotations

import asyncio

from tokenmill.config import EngineConfig
from tokenmill.frontend.core_client import AsyncEngineCoreClient, CoreClient, EngineCoreClient
from tokenmill.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClientBase(CoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.core.engine_core import EngineCore  # imports torch: only when asked for
        super().__init__(config.trace_steps, 1)  # one worker, in this process
        self.engine = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, handles: list[int]) -> None:
        self.engine.abort_requests(handles)

    def _call_now(self, method: str):
        return getattr(self.engine, method)()

    def _stop_core(self) -> None:
        self.engine.shutdown()


class InprocClient(InprocClientBase, EngineCoreClient):
    def get_outputs(self) -> EngineCoreOutputs:
        """One step's outputs (possibly none)."""
        return self.engine.step()

    def call(self, method: str):
        return self._call_now(method)

    def drain(self) -> None:
        while self.engine.in_flight:
            self.engine.step()


class AsyncInprocClient(InprocClientBase, AsyncEngineCoreClient):
    """Steps run on the event loop's thread (blocking it for a forward pass)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._work = asyncio.Event()  # set when a request arrives

    def add_request(self, request: EngineCoreRequest) -> None:
        super().add_request(request)
        self._work.set()

    async def get_outputs(self) -> EngineCoreOutputs:
        while True:
            while not self.engine.has_work():
                self._work.clear()
                await self._work.wait()
            await asyncio.sleep(0)  # let consumers run between steps
            outputs = self.engine.step()
            if not outputs.is_empty():
                return outputs

    async def call(self, method: str):
        return self._call_now(method)
