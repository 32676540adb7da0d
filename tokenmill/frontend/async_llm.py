"""The asyncio front-end: `async for out in engine.generate(prompt, params, request_id)`.

Requests go through the `EngineFrontend` like `LLM`'s; `AsyncLLM` only waits, awaiting. One
background task pulls `EngineCoreOutputs` from the core, has the front-end process them
and hands each `RequestOutput` (or a request's failure) to its request's queue. Outputs
come as the params' `output_kind` says (DELTA, CUMULATIVE or FINAL_ONLY). A consumer that
stops early (cancelled, or leaving its `async for`) aborts its request in the core. Once
the core is dead, every waiting and later request raises `EngineDeadError`.

Liveness, for a server that must notice a dead or stalled engine even while idle:
`start_output_handler()` reads the core's outputs from then on; `dead_error` is the failure
once the engine is dead; `stalled_for()` is how long requests have been pending without a
step finishing (the core reports at least every HEARTBEAT_S while it has work);
`declare_dead(reason)` fails everything and kills a core that stopped answering.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.core_client import AsyncEngineCoreClient
from tokenmill.frontend.engine_frontend import EngineFrontend
from tokenmill.frontend.inproc_client import AsyncInprocClient
from tokenmill.frontend.input_processor import PreparedRequest, Prompt
from tokenmill.frontend.mp_client import AsyncMPClient
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import TelemetryReport
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What a request's queue carries: an output, its failure, or None once aborted through abort().
_QueueItem = RequestOutput | BaseException | None


class AsyncLLM:
    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        """Starts the engine (blocking, like `LLM`); create it before serving requests."""
        self.frontend = EngineFrontend.from_kwargs(model, kwargs)
        self.client: AsyncEngineCoreClient = self.frontend.start(AsyncInprocClient, AsyncMPClient)
        self._queues: dict[str, asyncio.Queue[_QueueItem]] = {}
        self._handler: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._auto_ids = itertools.count()
        self._progress_at = time.monotonic()  # the last step news, or when work began after idling

    @property
    def config(self) -> EngineConfig:
        return self.frontend.config

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    async def generate(self, prompt: Prompt | PreparedRequest, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """A `PreparedRequest` (from `frontend.prepare`) carries its own params: give no
        `sampling_params` with it."""
        self._check_alive()
        request = self.frontend.request(prompt, sampling_params).with_lora(self.frontend.lora_ref(lora_request))
        request_id = request_id if request_id is not None else f"async-{next(self._auto_ids)}"
        if not self.frontend.has_unfinished():
            self._progress_at = time.monotonic()  # a stall is counted from when work begins
        self.frontend.submit(request_id, request)  # refuses an id already running
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
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
            if not finished:  # cancelled, closed early, failed, or the engine died
                self.frontend.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its consumer's iteration ends without a final output."""
        self.frontend.abort(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(None)

    async def kv_cache_stats(self) -> dict[str, int]:
        self._ready_for_calls()
        return msgspec.structs.asdict(await self.client.kv_cache_stats())

    async def scheduler_stats(self) -> dict[str, int | float]:
        self._ready_for_calls()
        return msgspec.structs.asdict(await self.client.scheduler_stats())

    async def telemetry(self) -> TelemetryReport:
        """Every process's message counters and step timings (see `LLM.telemetry`)."""
        self._ready_for_calls()
        return await self.client.telemetry_report()

    async def reset_telemetry(self) -> None:
        self._ready_for_calls()
        await self.client.reset_telemetry()

    # ------------------------------------------------------------------ liveness

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine is dead; None while it runs."""
        return self._dead

    def stalled_for(self) -> float:
        """Seconds that requests have been pending without any step news (0 when idle)."""
        if not self.frontend.has_unfinished():
            return 0.0
        return time.monotonic() - self._progress_at

    def start_output_handler(self) -> None:
        """Read the core's outputs from now on, so that its death is noticed even while idle
        (otherwise reading starts with the first request). Call it from the event loop."""
        if self._dead is None:
            self._ensure_handler()

    def declare_dead(self, reason: str) -> None:
        """End the engine from the front-end's side (a core that stopped answering): every
        waiting and later request fails with EngineDeadError(reason); the core is killed."""
        if self._dead is not None:
            return
        logger.error("declaring the engine dead: %s", reason)
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self._fail_all(EngineDeadError(reason))
        self.client.kill_core()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def _ready_for_calls(self) -> None:
        """A utility call is answered through the output handler: it must be running."""
        self._check_alive()
        self._ensure_handler()

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._handle_outputs(),
                                                                   name="tokenmill-outputs")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.client.get_outputs()
                self._progress_at = time.monotonic()
                processed = self.frontend.process(outputs)
                for request_id, failure in processed.failures.items():
                    self._put(request_id, failure)
                for out in processed.request_outputs:
                    self._put(out.request_id, out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not isinstance(exc, EngineDeadError):
                logger.exception("output handler failed")
                exc = EngineDeadError(f"output handler failed: {type(exc).__name__}: {exc}")
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        for queue in self._queues.values():
            queue.put_nowait(exc)

    def _put(self, request_id: str, item: _QueueItem) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def shutdown(self) -> None:
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self.frontend.shutdown()
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
