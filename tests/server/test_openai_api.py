"""The shared server driven by the official `openai` client: the API's shapes and numbers."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_models_version_health_openapi(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # public
    assert httpx.get(f"{server.base_url}/version", headers=server.headers).json()["version"]
    schema = httpx.get(f"{server.base_url}/openapi.json", headers=server.headers).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(schema["paths"])


def test_completion_usage_and_seed(client) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=7, temperature=0.9, seed=3,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == len("hello world")  # one byte-level token per character
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(model=MODEL, prompt="hello world", max_tokens=7, temperature=0.9, seed=3,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text  # same seed, same text


def test_completion_n2_multi_prompt_and_token_ids(client) -> None:
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16


def test_streaming_completion_matches_usage(client) -> None:
    stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6 and usage.prompt_tokens == 3
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text


def test_stop_string_ends_the_text(client) -> None:
    base = client.completions.create(model=MODEL, prompt="xyz", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # The seed-0 tiny model's greedy text is fixed: stop at its first printable character past two.
    printable = [ch for ch in base[2:] if ch.isprintable() and ch != "\ufffd"]
    assert printable, f"nothing printable to stop at in {base!r}: choose another prompt"
    stop = printable[0]
    out = client.completions.create(model=MODEL, prompt="xyz", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.text == base[:base.index(stop)]


def test_completion_logprobs_shape(client) -> None:
    out = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=5, logprobs=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    # The top 3 plus the chosen token, keyed by text (bytes that decode alike share a key).
    assert all(1 <= len(top) <= 4 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    echoed = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, logprobs=1, echo=True,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text.startswith("ab") and len(echoed.logprobs.tokens) == 4
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.tokens[:2] == ["a", "b"]


def test_chat_and_chat_streaming_agree(client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_chat_default_max_tokens_is_the_context_left(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 200}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == 256  # the tiny model's max_model_len


def test_chat_logprobs_shape_and_n(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], n=2,
                                         max_tokens=4, logprobs=True, top_logprobs=2, seed=1,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        for entry in content:
            assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_vllm_extra_sampling_fields(client) -> None:
    out = client.completions.create(model=MODEL, prompt="extras", max_tokens=5, temperature=0.8,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"70": 5.0},
                                    user="someone",
                                    extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2,
                                                "min_tokens": 5, "stop_token_ids": [2], "ignore_eos": False})
    assert out.usage.completion_tokens == 5


def test_tokenize_detokenize(server) -> None:
    h = server.headers
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "héllo"}, headers=h).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 256
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids["tokens"]}, headers=h).json()
    assert text["prompt"] == "héllo"
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "a"}]},
                      headers=h).json()
    assert chat["count"] > 3


def test_metrics_names(server, client) -> None:
    client.completions.create(model=MODEL, prompt="m", max_tokens=2, extra_body={"ignore_eos": True})
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401  # not public without the flag
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    for name in ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
                 "tokenmill:prefix_cache_hits_total", "tokenmill:prefix_cache_queries_total",
                 "tokenmill:num_preemptions_total", "tokenmill:prompt_tokens_total",
                 "tokenmill:generation_tokens_total", 'tokenmill:request_success_total{finished_reason="length"',
                 "tokenmill:time_to_first_token_seconds_bucket", "tokenmill:inter_token_latency_seconds_bucket",
                 "tokenmill:e2e_request_latency_seconds_bucket"):
        assert name in text, name
