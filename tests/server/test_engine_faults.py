"""A real server whose engine fails mid-flight: a worker or the core SIGKILLed, a worker hung
(SIGSTOP: the core's step timeout), a step that raises (injected), the core hung (SIGSTOP: the
front-end's stall watchdog). Each time every in-flight request ends with an error (a stream
error event then [DONE], a 503 body; never a silent close), /health answers 503, and
`tokenmill serve` exits with status 3 (ExitStatus.ENGINE_DEAD) within 15 s of the engine's
death, leaving no process behind. A row-level fault, by contrast, fails only its request.

With TOKENMILL_FAULT_TIMES=path set, each test appends its times (fault to error, fault to
exit) to that file as a JSON line (docs/results/soak-cpu.md quotes them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.procs import alive, descendants, wait_gone
from tests.server.conftest import TINY_ENGINE, start_server, stop_server
from tokenmill.entrypoints.openai.exit_status import ExitStatus
from tokenmill.entrypoints.openai.server import STALL_GRACE_S

STEP_TIMEOUT_S = 2.0
EXIT_BUDGET_S = 15.0  # from the engine's death (or the hang's detection) to the server's exit
MARKER = 7  # the injected step fault's victims: prompts starting with this token id
PROMPT = [40, 41, 42, 43, 44, 45]


def _pids(server_pid: int, module: str) -> set[int]:
    found = set()
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if module.encode() in f.read():
                    found.add(pid)
        except FileNotFoundError:
            pass
    return found


def _signal(module: str, sig: signal.Signals) -> Callable[[int], None]:
    def inflict(server_pid: int) -> None:
        victims = _pids(server_pid, module)
        assert victims, f"no {module} process"
        for pid in victims:
            os.kill(pid, sig)
    return inflict


@dataclass(frozen=True)
class Fault:
    name: str
    inflict: Callable[[int], None] | None  # None: an injected fault fires by itself
    detected_after_s: float = 0.0  # how long the engine takes to be declared dead (a hang's timeout)
    env: dict[str, str] = field(default_factory=dict)
    log_says: str = ""  # the reason, as the server's log gives it
    stalled_first: bool = False  # /health says engine_stalled before engine_dead


FAULTS = [
    Fault("worker_sigkill", _signal("tokenmill.worker.worker_proc", signal.SIGKILL), log_says="died unexpectedly"),
    Fault("core_sigkill", _signal("tokenmill.core.engine_core_proc", signal.SIGKILL), log_says="died unexpectedly"),
    Fault("worker_sigstop", _signal("tokenmill.worker.worker_proc", signal.SIGSTOP), STEP_TIMEOUT_S,
          log_says="step_timeout"),
    Fault("step_exception", None, env={"TOKENMILL_TEST_FAULTS": json.dumps(
        {"step_error": {"marker_token": MARKER, "after": 4}})}, log_says="injected step fault"),
    Fault("core_sigstop", _signal("tokenmill.core.engine_core_proc", signal.SIGSTOP),
          STEP_TIMEOUT_S + STALL_GRACE_S, log_says="stalled", stalled_first=True),
]


class HealthProbe(threading.Thread):
    """GET /health every 50 ms until the server is gone: [(time, status, error code)]."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/health"
        self.seen: list[tuple[float, int, str | None]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = httpx.get(self.url, timeout=5)
            except httpx.TransportError:
                if self.seen and self.seen[-1][1] != 200:
                    return  # the server has gone
                time.sleep(0.05)
                continue
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            self.seen.append((time.monotonic(), r.status_code, code))
            time.sleep(0.05)


def _stream(url: str, prompt: list[int], events: list[tuple[float, str]], first: threading.Event) -> None:
    body = {"prompt": prompt, "max_tokens": 240, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))
                first.set()


def _record(fault: str, **times: float) -> None:
    path = os.environ.get("TOKENMILL_FAULT_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, **{k: round(v, 3) for k, v in times.items()}}) + "\n")


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_engine_fault_fails_in_flight_requests_and_exits(fault: Fault, tiny_chat_model, tmp_path) -> None:
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE, "--step-timeout", str(STEP_TIMEOUT_S),
                       api_key=None, env=fault.env)
    tree = descendants(srv.proc.pid)
    url = f"{srv.base_url}/v1/completions"
    probe = HealthProbe(srv.base_url)
    streams = [[], []]
    firsts = [threading.Event(), threading.Event()]
    prompts = [[MARKER, *PROMPT] if fault.inflict is None else PROMPT, PROMPT[::-1]]
    plain: dict = {}

    def post() -> None:
        plain["response"] = httpx.post(url, json={"prompt": PROMPT[1:], "max_tokens": 240, "ignore_eos": True},
                                       timeout=60)

    threads = [threading.Thread(target=_stream, args=(url, p, e, f)) for p, e, f in zip(prompts, streams, firsts)]
    threads.append(threading.Thread(target=post))
    try:
        probe.start()
        for t in threads:
            t.start()
        assert all(f.wait(30) for f in firsts), "no token streamed"
        fault_at = time.monotonic()
        if fault.inflict is not None:
            fault.inflict(srv.proc.pid)
        for t in threads:
            t.join(fault.detected_after_s + 20)
        assert not any(t.is_alive() for t in threads), "a request never ended"
        code = srv.proc.wait(timeout=fault.detected_after_s + EXIT_BUDGET_S + 5)
        exit_at = time.monotonic()
    finally:
        probe.stop.set()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    log = srv.log()
    assert code == ExitStatus.ENGINE_DEAD, log
    assert fault.log_says in log, log

    error_times = []
    for events in streams:
        assert events[-1][1] == "[DONE]", events[-3:]
        error = json.loads(events[-2][1])["error"]
        assert error["code"] == "engine_dead", error
        finishes = [c["finish_reason"] for _, e in events[:-2] for c in json.loads(e)["choices"]]
        assert not any(finishes), "the request finished before the fault"
        error_times.append(events[-2][0])
    response = plain["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", response.text
    if fault.inflict is None:  # injected: it fired after the victim's last token
        fault_at = max(t for t, _ in streams[0][:-2])

    after = [(t, status, c) for t, status, c in probe.seen if t >= fault_at]
    failing = [(t, c) for t, status, c in after if status != 200]
    assert failing and all(status == 503 for _, status, _ in after if status != 200), after
    codes = [c for _, c in failing]
    # Order of events, not durations: once failing, /health never answers 200 again; a stalled
    # core is reported stalled (after the step timeout: the server's own check) before dead.
    statuses = [status for _, status, _ in after]
    assert 200 not in statuses[statuses.index(503):], statuses
    assert codes[-1] == "engine_dead", codes
    if fault.stalled_first:
        assert codes[0] == "engine_stalled", codes
        assert codes == sorted(codes, key=lambda c: c != "engine_stalled"), codes

    dead_at = max(error_times)
    assert dead_at - fault_at < fault.detected_after_s + 5.0
    assert exit_at - dead_at < EXIT_BUDGET_S
    # The server lingered: /health answered 503 engine_dead after the last request's error event.
    assert any(t >= dead_at and c == "engine_dead" for t, c in failing), (dead_at, failing[-3:])
    assert not wait_gone(tree, 5.0), "engine processes outlived the server"
    _record(fault.name, to_error_s=dead_at - fault_at, to_exit_s=exit_at - fault_at,
            exit_after_error_s=exit_at - dead_at)


def test_row_faults_fail_only_their_request_over_http(tiny_chat_model, tmp_path) -> None:
    """NaN logits in a streaming request's row: an error event (request_failed) then [DONE]; a
    sampling error in a non-streaming one: a 500 naming the failure; the request running beside
    them completes, and the server goes on serving with nothing held."""
    plan = {"nan_logits": {"marker_token": MARKER, "after": 2}, "sampling_error": {"marker_token": MARKER + 1}}
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE, "--enable-debug-routes", api_key=None,
                       env={"TOKENMILL_TEST_FAULTS": json.dumps(plan)})
    url = f"{srv.base_url}/v1/completions"
    events: list[tuple[float, str]] = []
    first = threading.Event()
    results: dict = {}

    def post(name: str, prompt: list[int]) -> None:
        results[name] = httpx.post(url, json={"prompt": prompt, "max_tokens": 64, "ignore_eos": True}, timeout=60)

    threads = [threading.Thread(target=_stream, args=(url, [MARKER, *PROMPT], events, first)),
               threading.Thread(target=post, args=("sampling", [MARKER + 1, *PROMPT])),
               threading.Thread(target=post, args=("bystander", PROMPT))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        error = json.loads(events[-2][1])["error"]
        assert events[-1][1] == "[DONE]" and error["code"] == "request_failed", events[-3:]
        assert "non-finite logits" in error["message"] and len(events) > 2  # failed midway
        failed = results["sampling"]
        assert failed.status_code == 500 and failed.json()["error"] == {
            "message": "sampling failed for this request", "type": "server_error", "param": None,
            "code": "request_failed"}
        bystander = results["bystander"].json()
        assert bystander["usage"]["completion_tokens"] == 64, bystander
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        again = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert again.status_code == 200
        idle = srv.wait_engine_idle()
        assert idle["kv_cache"]["num_requests"] == 0 and idle["admitted_sequences"] == 0, idle
        assert idle["kv_cache"]["num_free_blocks"] == idle["kv_cache"]["num_blocks"], idle
    finally:
        code = stop_server(srv)
    assert code == ExitStatus.STOPPED, srv.log()
