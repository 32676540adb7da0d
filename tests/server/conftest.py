"""A real `tokenmill serve` subprocess on a free loopback port, shared by the server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import descendants, wait_gone
from tests.helpers.tiny_models import make_tiny_model_dir

REPO = str(Path(__file__).resolve().parents[2])
API_KEY = "test-key-123"
# A template that renders every role, so the tiny byte-level model can chat.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
TINY_ENGINE = ["--dtype", "float32", "--kv-cache-memory-gb", "0.01"]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def engine_stats(self) -> dict:
        return httpx.get(f"{self.base_url}/debug/engine", headers=self.headers, timeout=10).json()

    def wait_engine_idle(self, timeout_s: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine_stats()
            kv = stats["kv_cache"]
            if (kv["num_requests"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
                    and stats["admitted_sequences"] == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_dir: Path, *args: str, api_key: str | None = API_KEY,
                 timeout_s: float = 90.0, env: dict[str, str] | None = None) -> Server:
    """`env`: extra environment variables (e.g. test-only fault injection)."""
    port = free_port()
    log_path = str(log_dir / f"server-{port}.log")
    argv = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port),
            "--uvicorn-log-level", "warning", *args]
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    env.pop("TOKENMILL_API_KEY", None)
    if api_key:
        argv += ["--api-key", api_key]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy in {timeout_s} s:\n{server.log()}")


def stop_server(server: Server, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait, and check that no process of the server's tree is left."""
    children = descendants(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        raise AssertionError(f"server ignored SIGTERM:\n{server.log()}")
    assert not wait_gone(children, 10.0), "server children outlived it"
    return code


def make_chat_model(tmp_dir: Path) -> str:
    path = make_tiny_model_dir("llama", tmp_dir)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    return make_chat_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="session")
def server(tiny_chat_model, tmp_path_factory):
    """The shared server: API key, debug routes, small bounds that the limit tests probe."""
    srv = start_server(tiny_chat_model, tmp_path_factory.mktemp("server-logs"), *TINY_ENGINE,
                       "--enable-debug-routes", "--served-model-name", "tiny", "--max-n", "8",
                       "--max-prompts", "4", "--max-stop", "4", "--max-stop-chars", "20",
                       "--max-stop-token-ids", "4", "--max-logit-bias", "8", "--max-messages", "16",
                       "--max-body-bytes", "65536", "--max-header-bytes", "8192")
    yield srv
    assert stop_server(srv) == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()
