"""A burst of long prompts whose KV is several times the pool: the server queues them (bounded:
beyond max_num_seqs + max_queued_requests it answers 503 with Retry-After), the scheduler
preempts and recomputes, and every admitted request completes in full; nothing crashes and
nothing is left held. (That preempted requests still produce the right tokens is proved by
tests/engine/test_schedule_invariance.py.)"""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.server.conftest import TINY_ENGINE, start_server, stop_server

MAX_SEQS, MAX_QUEUED, NUM_BLOCKS, BLOCK = 4, 8, 48, 16
PROMPT_LEN, MAX_TOKENS = 100, 150  # 250 tokens = 16 blocks each; 12 requests want 192 blocks of 48


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_long_prompt_burst_is_queued_preempted_and_bounded(tiny_chat_model, tmp_path) -> None:
    srv = start_server(tiny_chat_model, tmp_path, *TINY_ENGINE, "--num-gpu-blocks-override", str(NUM_BLOCKS),
                       "--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                       "--enable-debug-routes", api_key=None)
    url = f"{srv.base_url}/v1/completions"
    burst = MAX_SEQS + MAX_QUEUED

    async def stream(client: httpx.AsyncClient, i: int) -> list[dict]:
        body = {"prompt": [3 + (i * 7 + j) % 250 for j in range(PROMPT_LEN)], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            return [json.loads(line[6:]) for line in [x async for x in response.aiter_lines()]
                    if line.startswith("data: ") and line != "data: [DONE]"]

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=burst + 4)) as client:
            tasks = [asyncio.ensure_future(stream(client, i)) for i in range(burst)]
            for _ in range(400):  # until the whole burst is admitted
                stats = (await client.get(f"{srv.base_url}/debug/engine")).json()
                if stats["admitted_sequences"] == burst:
                    break
                await asyncio.sleep(0.01)
            refused = await client.post(url, json={"prompt": "one too many", "max_tokens": 2})
            results = await asyncio.gather(*tasks)
            after = await client.post(url, json={"prompt": "room again", "max_tokens": 2})
            return stats, refused, results, after

    try:
        stats, refused, results, after = asyncio.run(main())
        assert stats["admitted_sequences"] == burst, stats
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded", refused.text
        assert int(refused.headers["retry-after"]) >= 1
        for chunks in results:
            assert "error" not in chunks[-1], chunks[-1]
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert after.status_code == 200
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        assert _metric(metrics, "tokenmill:num_preemptions_total") > 0, "the burst never preempted"
        idle = srv.wait_engine_idle()
        assert idle["kv_cache"]["num_free_blocks"] == NUM_BLOCKS and idle["kv_cache"]["num_requests"] == 0, idle
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
    finally:
        code = stop_server(srv)
    assert code == 0 and "Traceback" not in srv.log(), srv.log()
