"""Runs the app on uvicorn, and shuts down gracefully on SIGTERM / SIGINT, or when the engine dies.

First signal: stop admitting (new requests get 503), give in-flight requests
`shutdown_timeout` seconds, abort what is left (those answers end with
finish_reason "abort"), then stop uvicorn and the engine, reaping its processes.
A second signal stops at once (in-flight requests are cut off).

A watchdog follows the engine: once it is dead (a process died, a step hung or raised), or
has had requests pending with no step finishing for `step_timeout` + STALL_GRACE_S (a core
that stopped answering, then killed), in-flight requests already hold their error (a 503
body or a stream error event). The server answers 503 for DEAD_LINGER_S more, then uvicorn
lets open responses finish and the server exits with ExitStatus.ENGINE_DEAD, so that a
supervisor restarts it.
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
from tokenmill.entrypoints.openai.exit_status import ExitStatus
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_ABORTED_GRACE_S = 5.0  # for aborted requests to send their last bytes
_WATCH_S = 0.2  # how often the watchdog looks at the engine
STALL_GRACE_S = 5.0  # beyond step_timeout: the core's own step timeout gets to report first
DEAD_LINGER_S = 2.0  # a dead engine's server still answers 503 this long before it exits


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_status = ExitStatus.STOPPED

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watchdog = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    async def _watch_engine(self) -> None:
        engine = self.state.engine
        engine.start_output_handler()
        stall_limit = engine.config.step_timeout_s + STALL_GRACE_S
        while not self.should_exit:
            stalled = engine.stalled_for()
            if engine.dead_error is None and stalled > stall_limit:
                engine.declare_dead(f"no engine step finished for {stalled:.0f} s with requests pending "
                                    f"(step_timeout {engine.config.step_timeout_s:g} s): the engine core stalled")
            if engine.dead_error is not None:
                logger.error("the engine is dead (%s): stopping with exit status %d", engine.dead_error,
                             ExitStatus.ENGINE_DEAD)
                self.exit_status = ExitStatus.ENGINE_DEAD
                # In-flight requests hold their error already. For DEAD_LINGER_S more, /health and
                # new requests are answered 503 (a load balancer sees it); then uvicorn stops.
                await asyncio.sleep(DEAD_LINGER_S)
                self.should_exit = True
                return
            await asyncio.sleep(_WATCH_S)

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


async def serve(engine_args: EngineArgs, settings: ServerSettings) -> ExitStatus:
    engine = AsyncLLM(**dataclasses.asdict(engine_args))
    try:
        app = build_app(engine, settings)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level, http="h11",
            loop="none", lifespan="off", timeout_graceful_shutdown=int(_ABORTED_GRACE_S),
            # h11 refuses (400) anything far beyond our own limit before buffering it all.
            h11_max_incomplete_event_size=4 * settings.max_header_bytes + 8192)
        server = _DrainingServer(config, app.state.tokenmill)
        await server.serve()
    finally:
        engine.shutdown()
    logger.info("server stopped (exit status %d)", server.exit_status)
    return server.exit_status


def run(engine_args: EngineArgs, settings: ServerSettings) -> ExitStatus:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(engine_args, settings))
    return uvloop.run(serve(engine_args, settings))
