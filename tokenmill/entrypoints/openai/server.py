"""Runs the app on uvicorn, and shuts down gracefully on SIGTERM / SIGINT.

First signal: stop admitting (new requests get 503), give in-flight requests
`shutdown_timeout` seconds, abort what is left (those answers end with
finish_reason "abort"), then stop uvicorn and the engine, reaping its processes.
A second signal stops at once (in-flight requests are cut off).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from types import FrameType

import uvicorn

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.openai.app import build_app
from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_ABORTED_GRACE_S = 5.0  # for aborted requests to send their last bytes


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would re-raise the signal after serving, killing us before cleanup.
        if self._drain_task is not None or self._loop is None:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        logger.info("%s: draining (at most %.1f s)", signal.Signals(sig).name, self.state.settings.shutdown_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        admission = self.state.admission
        admission.draining = True
        if not await admission.wait_idle(self.state.settings.shutdown_timeout):
            ids = admission.in_flight_request_ids()
            logger.warning("aborting %d request(s) still running after the shutdown timeout", len(ids))
            for request_id in ids:
                await self.state.engine.abort(request_id)
            await admission.wait_idle(_ABORTED_GRACE_S)
        self.should_exit = True


async def serve(engine_args: EngineArgs, settings: ServerSettings) -> None:
    engine = AsyncLLM(**dataclasses.asdict(engine_args))
    try:
        app = build_app(engine, settings)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level, http="h11",
            loop="none", lifespan="off", timeout_graceful_shutdown=int(_ABORTED_GRACE_S),
            # h11 refuses (400) anything far beyond our own limit before buffering it all.
            h11_max_incomplete_event_size=4 * settings.max_header_bytes + 8192)
        await _DrainingServer(config, app.state.tokenmill).serve()
    finally:
        engine.shutdown()
    logger.info("server stopped")


def run(engine_args: EngineArgs, settings: ServerSettings) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(engine_args, settings))
    else:
        uvloop.run(serve(engine_args, settings))
