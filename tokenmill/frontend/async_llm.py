"""The asyncio front-end: `async for out in engine.generate(prompt, params, request_id)`.

One background task pulls `EngineCoreOutputs` from the core, runs them through the
`OutputProcessor` (detokenization, stop strings; handles a stop string ends are aborted in
the core) and hands each `RequestOutput` to its request's queue. Outputs come as the
params' `output_kind` says (DELTA, CUMULATIVE or FINAL_ONLY). A consumer that stops early
(cancelled, or leaving its `async for`) aborts its request in the core. Once the core is
dead, every waiting and later request raises `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenmill.config import EngineArgs
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.core_client import AsyncEngineCoreClient, make_async_client
from tokenmill.frontend.input_processor import Prompt
from tokenmill.frontend.setup import build_frontend
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import TelemetryReport
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        """Starts the engine (blocking, like `LLM`); create it before serving requests."""
        parts = build_frontend(model, kwargs)
        self.engine_args, self.config, self.tokenizer = parts.engine_args, parts.config, parts.tokenizer
        self.input_processor, self.output_processor = parts.input_processor, parts.output_processor
        self.client: AsyncEngineCoreClient = make_async_client(self.config, self.engine_args.single_process)
        self._queues: dict[str, asyncio.Queue] = {}
        self._handler: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._auto_ids = itertools.count()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else f"async-{next(self._auto_ids)}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids = self.input_processor.tokenize(prompt)
        self.input_processor.validate(ids, params)
        requests = self.input_processor.make_requests(ids, params)
        self.output_processor.add_request(request_id, [r.handle for r in requests], text, ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            for request in requests:
                self.client.add_request(request)
            self._ensure_handler()
            while not finished:
                item = await queue.get()
                if item is None:  # aborted through abort()
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # cancelled, closed early, or the engine died
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its consumer's iteration ends without a final output."""
        self._abort_now(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(None)

    def _abort_now(self, request_id: str) -> None:
        handles = self.output_processor.abort_request(request_id)
        if handles and self._dead is None:
            self.client.abort_requests(handles)

    async def kv_cache_stats(self) -> dict[str, int]:
        self._check_alive()
        self._ensure_handler()
        return msgspec.structs.asdict(await self.client.kv_cache_stats())

    async def scheduler_stats(self) -> dict[str, int | float]:
        self._check_alive()
        self._ensure_handler()
        return msgspec.structs.asdict(await self.client.scheduler_stats())

    async def telemetry(self) -> TelemetryReport:
        """Every process's message counters and step timings (see `LLM.telemetry`)."""
        self._check_alive()
        self._ensure_handler()
        return await self.client.telemetry_report()

    async def reset_telemetry(self) -> None:
        self._check_alive()
        self._ensure_handler()
        await self.client.reset_telemetry()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._handle_outputs(),
                                                                   name="tokenmill-outputs")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.client.get_outputs()
                start = time.perf_counter()
                processed = self.output_processor.process_outputs(outputs)
                self.client.telemetry.record("process_outputs", start, time.perf_counter())
                if processed.handles_to_abort:
                    self.client.abort_requests(processed.handles_to_abort)
                for out in processed.request_outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not isinstance(exc, EngineDeadError):
                logger.exception("output handler failed")
                exc = EngineDeadError(f"output handler failed: {type(exc).__name__}: {exc}")
            self._dead = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)

    def shutdown(self) -> None:
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self.client.shutdown()
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
