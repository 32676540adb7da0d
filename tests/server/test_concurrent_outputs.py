"""Many requests at once through a real `tokenmill serve` answer what the offline engine answers.

72 concurrent completions on the tiny model, whose tokenizer here decodes each token to its own
string (byte-level tokens without the byte-level decoder, which would render every byte of an
invalid UTF-8 sequence as the same U+FFFD; special tokens kept), so equal texts are equal
tokens: greedy and seeded, streamed and not, of mixed prompt and output lengths,
and some streams cancelled midway by their client. Each completed answer (text, finish reason,
token count) must equal `LLM.generate`'s for the same request; each cancelled one must be a
prefix of it; afterwards the engine holds no request and no KV block, /metrics shows no request
running or waiting, and the cancelled ones were not run to the end."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.conftest import TINY_ENGINE, start_server, stop_server
from tokenmill import LLM, SamplingParams

NUM_REQUESTS = 72
CANCEL_AFTER_EVENTS = 3
CANCELLED_MAX_TOKENS = 200  # long enough to be cut short, within the tiny model's 256 positions


def workload() -> list[dict]:
    """Completion bodies (without model/stream) and what each request does with its answer."""
    rng = np.random.default_rng(27)
    requests = []
    for i in range(NUM_REQUESTS):
        cancel = i % 9 == 4  # 8 of them, all streamed
        body = {"prompt": rng.integers(5, 250, int(rng.integers(3, 40))).tolist(), "skip_special_tokens": False,
                "max_tokens": CANCELLED_MAX_TOKENS if cancel else [2, 7, 16, 33, 61][i % 5],
                "ignore_eos": cancel or i % 4 == 0}
        if i % 2:  # seeded
            body.update(temperature=0.9, top_k=[-1, 40][i % 4 == 1], top_p=[1.0, 0.9][i % 3 == 1], seed=1000 + i)
        else:
            body["temperature"] = 0.0
        requests.append({"body": body, "stream": cancel or i % 3 != 0, "cancel": cancel})
    return requests


def offline_params(body: dict) -> SamplingParams:
    return SamplingParams(temperature=body["temperature"], top_k=body.get("top_k", -1), top_p=body.get("top_p", 1.0),
                          seed=body.get("seed"), max_tokens=body["max_tokens"], ignore_eos=body["ignore_eos"],
                          skip_special_tokens=False)


@pytest.fixture(scope="module")
def char_model(tiny_chat_model, tmp_path_factory) -> str:
    """The tiny chat model, its tokenizer's decoder made to fuse the tokens' own characters."""
    path = tmp_path_factory.mktemp("char-model") / "llama"
    shutil.copytree(tiny_chat_model, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["decoder"] = {"type": "Fuse"}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(path)


@pytest.fixture(scope="module")
def server(char_model, tmp_path_factory):
    srv = start_server(char_model, tmp_path_factory.mktemp("concurrent-logs"), *TINY_ENGINE,
                       "--enable-debug-routes", "--served-model-name", "tiny")
    yield srv
    assert stop_server(srv) == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def offline_answers(char_model) -> list[dict]:
    """What `LLM.generate` answers to every request of the workload, in one batch."""
    requests = workload()
    with LLM(char_model, dtype="float32", kv_cache_memory_gb=0.01, single_process=True) as llm:
        outs = llm.generate([{"prompt_token_ids": r["body"]["prompt"]} for r in requests],
                            [offline_params(r["body"]) for r in requests], use_tqdm=False)
    # Each text is its tokens' own strings put together (specials included), so equal texts are
    # equal tokens (an EOS that ends a request adds no text).
    tokenizer = json.loads((Path(char_model) / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tokenizer["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tokenizer["added_tokens"]}
    for o in outs:
        ids = list(o.outputs[0].token_ids)[:-1 if o.outputs[0].finish_reason == "stop" else None]
        assert o.outputs[0].text == "".join(vocab[t] for t in ids), o.outputs[0]
    return [{"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason,
             "tokens": len(o.outputs[0].token_ids)} for o in outs]


async def _ask(client: httpx.AsyncClient, server, request: dict) -> dict:
    body = {"model": "tiny", **request["body"], "stream": request["stream"]}
    url = f"{server.base_url}/v1/completions"
    if not request["stream"]:
        response = await client.post(url, json=body, headers=server.headers)
        assert response.status_code == 200, response.text
        data = response.json()
        return {"text": data["choices"][0]["text"], "finish_reason": data["choices"][0]["finish_reason"],
                "tokens": data["usage"]["completion_tokens"]}
    body["stream_options"] = {"include_usage": True}
    texts, finish, tokens, events = [], None, None, 0
    async with client.stream("POST", url, json=body, headers=server.headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            events += 1
            if request["cancel"] and events == CANCEL_AFTER_EVENTS:
                return {"text": "".join(texts), "cancelled": True}  # leaving closes the connection
    return {"text": "".join(texts), "finish_reason": finish, "tokens": tokens}


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        m = re.match(r'^(tokenmill:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            reason = re.search(r'finished_reason="(\w+)"', m.group(2) or "")
            values[m.group(1) + (f"[{reason.group(1)}]" if reason else "")] = float(m.group(3))
    return values


def test_concurrent_answers_equal_the_offline_engine(server, offline_answers) -> None:
    requests = workload()
    generated_before = _metrics(server).get("tokenmill:generation_tokens_total", 0.0)  # (absent before any)

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            return await asyncio.gather(*(_ask(client, server, r) for r in requests))

    answers = asyncio.run(main())
    wrong = []
    for i, (request, got, want) in enumerate(zip(requests, answers, offline_answers)):
        if request["cancel"]:
            assert got.get("cancelled"), (i, got)
            if not (got["text"] and want["text"].startswith(got["text"]) and len(got["text"]) < len(want["text"])):
                wrong.append(f"request {i} (cancelled): got {got['text']!r}, not a proper prefix of {want['text']!r}")
        elif got != want:
            wrong.append(f"request {i} ({'seeded' if 'seed' in request['body'] else 'greedy'}, "
                         f"{'streamed' if request['stream'] else 'whole'}): got {got}, offline {want}")
    assert not wrong, f"{len(wrong)} of {NUM_REQUESTS} answers differ from LLM.generate's:\n" + "\n".join(wrong)

    # The cancelled requests left nothing behind.
    stats = server.wait_engine_idle()
    assert stats["kv_cache"]["num_requests"] == 0 and stats["admitted_sequences"] == 0, stats
    assert stats["kv_cache"]["num_free_blocks"] == stats["kv_cache"]["num_blocks"], stats
    deadline = time.monotonic() + 15
    while True:  # the gauges follow the engine's stats a moment later
        m = _metrics(server)
        if (m.get("tokenmill:num_requests_running") == 0 and m.get("tokenmill:num_requests_waiting") == 0
                or time.monotonic() > deadline):
            break
        time.sleep(0.1)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0, m
    # ...and were cut short: the engine generated fewer tokens than running them to the end takes.
    completed = sum(want["tokens"] for r, want in zip(requests, offline_answers) if not r["cancel"])
    cancelled = sum(r["cancel"] for r in requests)
    generated = m["tokenmill:generation_tokens_total"] - generated_before
    assert completed <= generated < completed + cancelled * CANCELLED_MAX_TOKENS // 2, (generated, completed)
