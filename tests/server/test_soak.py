"""`tokenmill bench soak`: its verdicts on crafted streams and figures (each check can fail), and
a 60-second soak of a real server (marked `soak`; it runs in CI; TOKENMILL_SOAK_S changes its
length) that must lose nothing and leak nothing."""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import API_KEY, TINY_ENGINE, start_server, stop_server
from tokenmill.benchmarks.soak import check_loopback, parse_mix, passed
from tokenmill.benchmarks.soak_checks import ProcessTree, reconcile
from tokenmill.benchmarks.soak_requests import KINDS, Outcome, SSEReader
from tokenmill.cli import main

SOAK_S = float(os.environ.get("TOKENMILL_SOAK_S", "60"))


def _read(*events: str) -> tuple[str, str]:
    reader = SSEReader()
    for event in events:
        reader.feed(f"data: {event}")
    return reader.verdict(1)


CHUNK = json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
LAST = json.dumps({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
ERROR = json.dumps({"error": {"code": "engine_dead", "message": "x"}})


def test_a_stream_must_end_exactly_once() -> None:
    assert _read(CHUNK, LAST, "[DONE]") == ("completed", "")
    assert _read(CHUNK, ERROR, "[DONE]") == ("failed", "engine_dead")
    assert _read(CHUNK, LAST)[0] == "lost"  # closed without [DONE]
    assert _read(CHUNK, LAST, "[DONE]", "[DONE]")[0] == "lost"
    assert _read(CHUNK, LAST, "[DONE]", CHUNK)[0] == "lost"  # news after the end
    assert _read(CHUNK, "[DONE]")[0] == "lost"  # no finish reason
    assert _read(CHUNK, LAST, LAST, "[DONE]")[0] == "lost"  # finished twice
    assert _read(CHUNK, ERROR, CHUNK, "[DONE]")[0] == "lost"  # news after an error
    assert _read(ERROR, ERROR, "[DONE]")[0] == "lost"


def _done(kind: str = "normal", prompt: int = 10, tokens: int = 5) -> Outcome:
    return Outcome(kind, "completed", 200, prompt_tokens=prompt, completion_tokens=tokens,
                   max_completion_tokens=tokens, finished_choices=1)


IDLE = {"kv_cache": {"num_requests": 0, "num_free_blocks": 8, "num_blocks": 8}, "admitted_sequences": 0}
TREE = ProcessTree(frozenset({1, 2, 3}), 40, frozenset({"/dev/shm/ring (deleted)"}))


def _metrics(prompt: float, gen: float, finished: float) -> dict[str, float]:
    return {"tokenmill:prompt_tokens_total": prompt, "tokenmill:generation_tokens_total": gen,
            "tokenmill:request_success_total{length}": finished}


def _failing(checks) -> list[str]:
    return [c.name for c in checks if not c.ok]


def test_reconciliation_passes_only_when_everything_adds_up() -> None:
    cancelled = Outcome("cancel", "cancelled", 200, prompt_tokens=7, completion_tokens=2, max_completion_tokens=8)
    rejected = Outcome("malformed", "rejected", 400)
    outcomes = [_done(), _done(), cancelled, rejected]
    zero = _metrics(0, 0, 0)
    assert not _failing(reconcile(outcomes, zero, _metrics(27, 13, 2), IDLE, TREE, TREE))
    assert not _failing(reconcile(outcomes, zero, _metrics(27, 18, 2), IDLE, TREE, TREE))  # within bounds
    assert _failing(reconcile(outcomes, zero, _metrics(27, 19, 2), IDLE, TREE, TREE)) == [
        "generated tokens = /metrics (within cancelled streams' bounds)"]
    assert _failing(reconcile(outcomes, zero, _metrics(28, 13, 2), IDLE, TREE, TREE)) == ["prompt tokens = /metrics"]
    assert _failing(reconcile(outcomes, zero, _metrics(27, 13, 3), IDLE, TREE, TREE)) == ["finished choices = /metrics"]
    lost = Outcome("stream", "lost", 200, detail="stream ended with 0 [DONE]")
    assert _failing(reconcile(outcomes + [lost], zero, _metrics(27, 13, 2), IDLE, TREE, TREE)) == [
        "sent = completed + cancelled + rejected + failed", "every request ended as its kind should"]
    wrong = Outcome("malformed", "completed", 200, finished_choices=0)
    assert _failing(reconcile([wrong], zero, zero, IDLE, TREE, TREE)) == ["every request ended as its kind should"]
    held = {"kv_cache": {"num_requests": 1, "num_free_blocks": 7, "num_blocks": 8}, "admitted_sequences": 0}
    assert _failing(reconcile(outcomes, zero, _metrics(27, 13, 2), held, TREE, TREE)) == [
        "engine holds no request and no KV block"]
    for leaky in (ProcessTree(TREE.pids | {4}, 40, TREE.shm), ProcessTree(TREE.pids, 41, TREE.shm),
                  ProcessTree(TREE.pids, 40, TREE.shm | {"/dev/shm/x"})):
        assert _failing(reconcile(outcomes, zero, _metrics(27, 13, 2), IDLE, TREE, leaky)) == [
            "no leaked processes, fds or shared memory"]
    overloaded = Outcome("normal", "failed", 503, detail="overloaded", overloaded=True)
    assert not _failing(reconcile(outcomes + [overloaded], zero, _metrics(27, 13, 2), IDLE, TREE, TREE))
    unchecked = reconcile(outcomes, zero, _metrics(27, 13, 2), None, None, None)
    assert [c.ok for c in unchecked][-2:] == [None, None]
    assert passed(unchecked)  # n/a is not a failure...
    assert not passed(reconcile(outcomes, zero, _metrics(28, 13, 2), None, None, None))  # ...a failed check is


def test_checks_that_cannot_run_are_na_not_failures(tiny_chat_model, tmp_path, capsys) -> None:
    """A short soak of a server without --enable-debug-routes: the checks that ran pass, the one
    that could not (the engine's idle state) says n/a and how to enable it; exit 0."""
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE)
    try:
        code = main(["bench", "soak", "--base-url", srv.base_url, "--api-key", API_KEY, "--request-rate", "8",
                     "--duration", "2", "--input-len", "8", "--output-len", "8", "--settle", "20"])
    finally:  # (no assertion here: it would hide the first failure)
        stopped = stop_server(srv)
    out = capsys.readouterr().out
    assert stopped == 0, srv.log()
    assert "[n/a ] engine holds no request and no KV block: GET /debug/engine is off: start the server " \
           "with --enable-debug-routes" in out, out
    assert "[ok  ] no leaked processes, fds or shared memory" in out, out  # (the server found by its port)
    assert "FAIL" not in out and "PASSED (1 check(s) n/a: see above how to enable them)" in out, out
    assert code == 0


def test_arguments_are_checked() -> None:
    assert check_loopback("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert check_loopback("http://[::1]:9000")[1] == 9000
    for url in ("http://10.0.0.1:8000", "http://example.com", "https://127.0.0.1:8000"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(url)
    assert parse_mix("normal=1,cancel=0.5") == {"normal": 1.0, "cancel": 0.5}
    for bad in ("nope=1", "normal=x", "normal=-1", "normal=0"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


@pytest.mark.soak
def test_soak_loses_and_leaks_nothing(tiny_chat_model, tmp_path) -> None:
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE, "--enable-debug-routes")
    record_path = tmp_path / "soak.json"
    try:
        code = main(["bench", "soak", "--base-url", srv.base_url, "--api-key", API_KEY, "--request-rate", "8",
                     "--duration", str(SOAK_S), "--input-len", "16", "--output-len", "24", "--settle", "30",
                     "--server-pid", str(srv.proc.pid), "--output-json", str(record_path)])
        record = json.loads(record_path.read_text())
    finally:  # (no assertion here: it would hide the first failure)
        stopped = stop_server(srv)
    assert stopped == 0, srv.log()
    failing = [c for c in record["checks"] if c["ok"] is not True]
    assert code == 0 and record["passed"] and not failing, (failing, record["problems"])
    assert record["states"]["lost"] == 0 and record["states"]["failed"] == record["overloaded_503"]
    assert all(record["by_kind"][kind]["sent"] > 0 for kind in KINDS)
    assert record["sent"] > 4 * SOAK_S  # the rate was held (8/s nominal)
    assert "Traceback" not in srv.log(), srv.log()
