"""The real default model behind the server: chat equals the offline LLM; admission control;
SIGTERM drains in-flight requests, aborts the rest, and exits with its processes reaped.

SmolLM2 is slow enough on CPU (tens of ms per token) that requests are still running
when the server is told to stop.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable

import httpx
import pytest

from tests.helpers.requirements import require_smollm2
from tests.server.conftest import start_server, stop_server
from tokenmill import SamplingParams

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT_S = 5.0
LONG_TOKENS = 1500  # never done within the drain window, on any CPU (KV: under 0.2 GB for two)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    require_smollm2()
    srv = start_server("smollm2", tmp_path_factory.mktemp("real-server"), "--dtype", "float32",
                       "--max-model-len", "2048", "--kv-cache-memory-gb", "0.2", "--max-num-seqs", "3",
                       "--max-queued-requests", "0", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                       "--public-metrics", "--enable-debug-routes", api_key=None)
    yield srv
    stop_server(srv)


def test_chat_matches_offline_llm(real_server, smollm2_llm) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = httpx.post(f"{real_server.base_url}/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    offline = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert body["model"] == "smollm2"  # the name it was served under
    assert httpx.get(f"{real_server.base_url}/metrics").status_code == 200  # --public-metrics


async def _first_event_then(client, url: str, body: dict, opened: asyncio.Event) -> list[dict | str]:
    events: list[dict | str] = []
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                opened.set()
    return events


def test_admission_control_refuses_beyond_the_queue(real_server) -> None:
    url = f"{real_server.base_url}/v1/completions"

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            opened = asyncio.Event()
            # n=3 fills max_num_seqs (3) + max_queued_requests (0).
            task = asyncio.ensure_future(_first_event_then(
                client, url, {"prompt": "Count:", "n": 3, "max_tokens": 300, "ignore_eos": True, "stream": True},
                opened))
            await asyncio.wait_for(opened.wait(), 60)
            refused = await client.post(url, json={"prompt": "more", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    stats = real_server.wait_engine_idle()
    assert stats["kv_cache"]["num_requests"] == 0 and stats["admitted_sequences"] == 0, stats


async def _events_and_end(events: Awaitable[list[dict | str]]) -> tuple[list[dict | str], float]:
    """A stream's events, and when it ended (time.monotonic())."""
    result = await events
    return result, time.monotonic()


async def _health_once_draining(client, base: str, timeout_s: float = 30.0) -> httpx.Response:
    """/health's answer once it is not 200 (the signal handled), or its last 200 after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = await client.get(f"{base}/health")
        if health.status_code != 200 or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.02)


def test_sigterm_drains_then_aborts_and_reaps(real_server) -> None:
    """The short request is streamed and SIGTERM sent once its first token arrived: it is certainly
    admitted and running, with two steps left to make within the drain window. (SIGTERM at a fixed
    0.3 s after the request gave its prefill and two steps 3.3 s, which a busy machine once took.)
    That the window is held is a lower bound the server keeps, whatever the load: the long stream's
    abort cannot reach us sooner than SHUTDOWN_TIMEOUT_S after SIGTERM was sent. /health is polled
    until the signal is handled, not read after a fixed delay."""
    base = real_server.base_url

    async def main() -> tuple:
        async with httpx.AsyncClient(timeout=120) as client:
            opened = asyncio.Event()
            long_stream = asyncio.ensure_future(_events_and_end(_first_event_then(
                client, f"{base}/v1/completions",
                {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True},
                opened)))
            long_plain = asyncio.ensure_future(client.post(f"{base}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": LONG_TOKENS,
                "ignore_eos": True}))
            await asyncio.wait_for(opened.wait(), 60)
            short_opened = asyncio.Event()
            short = asyncio.ensure_future(_first_event_then(
                client, f"{base}/v1/completions",
                {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}, short_opened))
            await asyncio.wait_for(short_opened.wait(), 60)
            signalled = time.monotonic()
            real_server.proc.send_signal(signal.SIGTERM)
            health = await _health_once_draining(client, base)
            refused = await client.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
            events, ended = await long_stream
            return health, refused, await short, await long_plain, events, ended - signalled

    start = time.monotonic()
    health, refused, short, long_plain, events, abort_after_s = asyncio.run(main())
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert short[0]["choices"][0]["finish_reason"] is None  # running when SIGTERM was sent (a token a step)
    assert short[-1] == "[DONE]" and short[-2]["usage"]["completion_tokens"] == 3, short
    assert [c["choices"][0]["finish_reason"] for c in short[:-2]][-1] == "length", short  # drained
    assert long_plain.status_code == 200
    aborted = long_plain.json()["choices"][0]
    assert aborted["finish_reason"] == "abort" and long_plain.json()["usage"]["completion_tokens"] < LONG_TOKENS
    assert events[-1] == "[DONE]"
    reasons = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1
    assert abort_after_s >= SHUTDOWN_TIMEOUT_S, abort_after_s  # the window held: not aborted at once
    assert stop_server(real_server, timeout_s=20) == 0, real_server.log()
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 20
    assert "Traceback" not in real_server.log(), real_server.log()
