"""Clients that go away abort their requests: the engine ends with no request and every KV block free."""

from __future__ import annotations

import asyncio
import json
import time

import httpx


async def _stream(client: httpx.AsyncClient, server, i: int, cancel: bool) -> str:
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 48, "temperature": 0.7, "seed": i,
            "stream": True, "ignore_eos": True}
    events = []
    async with client.stream("POST", f"{server.base_url}/v1/completions", json=body,
                             headers=server.headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if cancel and len(events) == 3:
                return "cancelled"  # leaving the block closes the connection mid-stream
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "done"


def test_100_concurrent_streams_a_third_cancelled(server) -> None:
    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, server, i, cancel=i % 3 == 0) for i in range(100)))

    results = asyncio.run(main())
    assert results.count("cancelled") == 34 and results.count("done") == 66
    stats = server.wait_engine_idle()
    assert stats["kv_cache"]["num_requests"] == 0, stats
    assert stats["kv_cache"]["num_free_blocks"] == stats["kv_cache"]["num_blocks"], stats
    assert stats["admitted_sequences"] == 0, stats


def test_non_streaming_client_that_times_out_aborts_its_request(server) -> None:
    body = {"model": "tiny", "prompt": "long one", "max_tokens": 240, "n": 8, "ignore_eos": True}
    before = _generated_tokens(server)
    try:
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=0.15)
        raise AssertionError("the request finished before the client gave up")
    except httpx.TimeoutException:
        pass
    stats = server.wait_engine_idle()
    assert stats["kv_cache"]["num_requests"] == 0 and stats["admitted_sequences"] == 0, stats
    assert stats["kv_cache"]["num_free_blocks"] == stats["kv_cache"]["num_blocks"], stats
    time.sleep(0.2)
    assert _generated_tokens(server) - before < 8 * 240  # aborted, not run to the end


def _generated_tokens(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    line = next((x for x in text.splitlines() if x.startswith("tokenmill:generation_tokens_total")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0
