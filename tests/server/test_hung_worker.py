"""A real server whose worker hangs (SIGSTOP): the step timeout ends the engine, the open stream
ends with an error event, and /health answers 503."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.e2e.procs import alive, descendants
from tests.server.conftest import TINY_ENGINE, start_server, stop_server

STEP_TIMEOUT_S = 2.0


def _worker_pids(server_pid: int) -> set[int]:
    found = set()
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tokenmill.worker.worker_proc" in f.read():
                    found.add(pid)
        except FileNotFoundError:
            pass
    return found


def test_hung_worker_gives_stream_error_and_health_503(tiny_chat_model, tmp_path):
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE, "--step-timeout", str(STEP_TIMEOUT_S),
                       api_key=None)
    workers = _worker_pids(srv.proc.pid)
    assert workers
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()

    thread = threading.Thread(target=stream)
    try:
        thread.start()
        assert first_chunk.wait(30), "no token streamed"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        thread.join(STEP_TIMEOUT_S + 15)
        assert not thread.is_alive(), "the stream never ended"
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert time.monotonic() - stopped_at < STEP_TIMEOUT_S + 15
        health = httpx.get(f"{srv.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        stop_server(srv)
