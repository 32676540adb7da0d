"""The front-end's handle on an engine-core process: sockets, startup handshake, liveness, cleanup.

Each handle makes a fresh temp dir for its ipc sockets (so engines never collide) and binds
both sockets before starting the core: input (PUSH, front-end -> core) and output (PULL).
Startup waits for READY, or fails fast with the core's own exception when it reports one or
exits. A monitor thread waits on the process, so a dead core is noticed even when nobody is
reading. The temp dir is removed as soon as startup ends (connections outlive socket files).
Cleanup (shutdown, garbage collection or interpreter exit, via weakref.finalize) stops the
core, closes the sockets and removes anything named after the temp dir that a failed
startup may have left.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref

import msgspec
import zmq

from tokenmill.child_process import spawn_child, spawned_by_main_thread, stop_process
from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError, exception_from_report
from tokenmill.protocol import CoreInputKind, CoreLaunch, CoreOutputKind, EngineCoreReady, ErrorReport
from tokenmill.transport.channels import LAST_WORDS_S, SHUTDOWN_TIMEOUT_S, EngineAddresses
from tokenmill.transport.shm_ring import SHM_DIR

logger = logging.getLogger(__name__)



class _Resources:
    """Everything cleanup needs, apart from the handle (so the finalizer does not keep it alive)."""

    def __init__(self, ctx: zmq.Context, run_dir: str) -> None:
        self.ctx = ctx
        self.run_dir = run_dir
        self.sockets: list[zmq.Socket] = []
        self.proc: subprocess.Popen | None = None
        self.send_lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.send_lock:
            if self.closed:
                return
            self.closed = True
            if self.proc is not None:
                if self.proc.poll() is None:
                    try:
                        self.sockets[0].send_multipart([bytes((CoreInputKind.SHUTDOWN,)), b""],
                                                       flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                stop_process(self.proc, SHUTDOWN_TIMEOUT_S)
            for sock in self.sockets:
                sock.close(linger=0)
            self.ctx.term()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            # Normally gone already (the core unlinks its ring once the workers map it).
            prefix = EngineAddresses(self.run_dir).shm_prefix
            for path in glob.glob(os.path.join(SHM_DIR, prefix + "-*")):
                try:
                    os.unlink(path)
                except OSError:
                    pass


class CoreProcess:
    def __init__(self, config: EngineConfig) -> None:
        """`config`: resolved here, in the front-end, so bad arguments never reach a child."""
        ctx = zmq.Context()
        res = _Resources(ctx, tempfile.mkdtemp(prefix="tokenmill-"))
        self._res = res
        self._finalizer = weakref.finalize(self, res.close)
        self.dead = threading.Event()
        self._error: ErrorReport | None = None
        self._error_decoder = msgspec.msgpack.Decoder(ErrorReport)
        try:
            self.input = ctx.socket(zmq.PUSH)
            self.input.setsockopt(zmq.SNDHWM, 0)  # sends never block
            res.sockets.append(self.input)
            self.output = ctx.socket(zmq.PULL)
            res.sockets.append(self.output)
            addresses = EngineAddresses(res.run_dir)
            self.input.bind(addresses.core_input)
            self.output.bind(addresses.core_output)
            start = time.perf_counter()
            res.proc = spawn_child("tokenmill.core.engine_core_proc", CoreLaunch(
                config=config, run_dir=res.run_dir, parent_pid=os.getpid(),
                log_level=logging.getLogger("tokenmill").getEffectiveLevel(),
                death_signal=spawned_by_main_thread()))
            self.ready = self._wait_ready()
            # Every socket is connected by now (the core and each worker connect before they
            # report ready), and ipc connections outlive their socket files: remove them now,
            # so that even a SIGKILLed front-end leaves nothing behind.
            shutil.rmtree(res.run_dir, ignore_errors=True)
            logger.info("engine core ready in %.1f s (pid %d)", time.perf_counter() - start, res.proc.pid)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._monitor, args=(res.proc,), name="core-monitor", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._res.proc.pid

    @property
    def run_dir(self) -> str:
        """This engine's temp dir (ipc sockets); shared-memory segments are named after it."""
        return self._res.run_dir

    def _wait_ready(self) -> EngineCoreReady:
        proc = self._res.proc
        while True:
            if self.output.poll(100):
                kind, payload = self.output.recv_multipart()
                if kind[0] == CoreOutputKind.READY:
                    return msgspec.msgpack.decode(payload, type=EngineCoreReady)
                if kind[0] == CoreOutputKind.ERROR:
                    raise exception_from_report(self._error_decoder.decode(payload), "the engine core")
                raise RuntimeError(f"engine core sent message kind {kind[0]} before READY")
            if proc.poll() is not None:
                if self.output.poll(int(LAST_WORDS_S * 1000)):
                    continue  # its last words arrived
                raise RuntimeError(f"the engine core exited with code {proc.returncode} during startup "
                                   f"(see its log above)")

    def _monitor(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.dead.set()

    @property
    def failed(self) -> bool:
        """The core exited, or said it is exiting (its ErrorReport arrived)."""
        return self.dead.is_set() or self._error is not None

    def send(self, kind: CoreInputKind, payload: bytes = b"") -> None:
        """Thread-safe; never blocks. Dropped silently once the core is gone (readers raise)."""
        with self._res.send_lock:
            if self._res.closed:
                raise EngineDeadError("the engine was shut down")
            if self.failed:
                return
            # A PUSH socket without a peer blocks: retry only while the core is alive.
            while True:
                try:
                    self.input.send_multipart([bytes((kind,)), payload], copy=False, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if self.failed or self._res.proc.poll() is not None:
                        return
                    time.sleep(0.001)

    def dead_error(self, report: ErrorReport | None = None) -> EngineDeadError:
        """The error every request gets once the core is gone; `report`: its last words, if any."""
        if report is not None:
            self._error = report
        if self._res.closed and self._error is None:
            return EngineDeadError("the engine was shut down")
        proc = self._res.proc
        if self._error is not None:
            text = f"the engine core failed: {self._error.exc_type}: {self._error.message}"
        else:
            text = f"the engine core died unexpectedly (exit code {proc.returncode if proc else None})"
        return EngineDeadError(text)

    def decode_error(self, payload) -> ErrorReport:
        return self._error_decoder.decode(payload)

    def kill(self) -> None:
        """SIGKILL a core that stopped answering (its workers die with it); `close` still cleans up."""
        proc = self._res.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._res.closed
