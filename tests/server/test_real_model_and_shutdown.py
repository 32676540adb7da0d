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

import httpx
import pytest

from tests.helpers.requirements import require_smollm2
from tests.server.conftest import start_server, stop_server
from tokenmill import SamplingParams

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT_S = 3.0


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


def test_sigterm_drains_then_aborts_and_reaps(real_server) -> None:
    base = real_server.base_url

    async def main() -> tuple:
        async with httpx.AsyncClient(timeout=120) as client:
            opened = asyncio.Event()
            long_stream = asyncio.ensure_future(_first_event_then(
                client, f"{base}/v1/completions",
                {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}, opened))
            long_plain = asyncio.ensure_future(client.post(f"{base}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 500,
                "ignore_eos": True}))
            await asyncio.wait_for(opened.wait(), 60)
            short = asyncio.ensure_future(client.post(f"{base}/v1/completions",
                                                      json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            real_server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = await client.get(f"{base}/health")
            refused = await client.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
            return health, refused, await short, await long_plain, await long_stream

    start = time.monotonic()
    health, refused, short, long_plain, events = asyncio.run(main())
    assert health.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert long_plain.status_code == 200
    aborted = long_plain.json()["choices"][0]
    assert aborted["finish_reason"] == "abort" and long_plain.json()["usage"]["completion_tokens"] < 500
    assert events[-1] == "[DONE]"
    reasons = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1
    assert stop_server(real_server, timeout_s=20) == 0, real_server.log()
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 20
    assert "Traceback" not in real_server.log(), real_server.log()
