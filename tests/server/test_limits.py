"""Every bound, malformed input and auth, answered in OpenAI's error envelope with the right status."""

from __future__ import annotations

import json

import httpx
import pytest


def _post(server, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> httpx.Response:
    h = {**server.headers, "content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=h, timeout=30)


def _error(response: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"] and "/work" not in err["message"] and " at 0x" not in err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


CMPL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("change, param", [
    ({"n": 9}, "n"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 21}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(9)}}, "logit_bias"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"seed": 2**64}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"min_tokens": 3}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": "two"}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [300]}, "prompt_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_bounds(server, change, param) -> None:
    _error(_post(server, "/v1/completions", {**CMPL, **change}), 400, param)


@pytest.mark.parametrize("change, param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}] * 17}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
    ({"max_completion_tokens": 1000}, "max_tokens"),
    # tools are supported (tests/server/test_structured_outputs.py); naming one that is not given is not
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_chat_bounds(server, change, param) -> None:
    _error(_post(server, "/v1/chat/completions", {**CHAT, **change}), 400, param)


def test_engine_field_named_as_the_request_names_it(server) -> None:
    """Chat's top_logprobs are the engine's logprobs: its one check of them speaks of top_logprobs."""
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}), 400,
                 "top_logprobs")
    assert err["message"] == "top_logprobs must be an integer in [0, 20], got 21"
    err = _error(_post(server, "/v1/completions", {**CMPL, "logprobs": 21}), 400, "logprobs")
    assert err["message"] == "logprobs must be an integer in [0, 20], got 21"


def test_context_length_message(server) -> None:
    err = _error(_post(server, "/v1/completions", {**CMPL, "prompt": "a" * 250, "max_tokens": 10}), 400)
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, you "
                                     "requested 260 tokens (250 in the prompt, 10 in the completion).")
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * 300}]}),
                 400, "messages")
    assert "in the messages" in err["message"]


def test_malformed_bodies(server) -> None:
    _error(_post(server, "/v1/completions", None, raw=b'{"prompt": "hi", '), 400, None)
    _error(_post(server, "/v1/completions", None, raw=b'[1, 2, 3]'), 400)
    _error(_post(server, "/v1/completions", None, raw=b'\xff\xfe garbage'), 400)
    _error(_post(server, "/v1/chat/completions", None, raw=b'"just a string"'), 400)
    _error(_post(server, "/v1/completions", {"prompt": "hi", "model": "other"}), 404, "model")
    _error(_post(server, "/v1/completions", {"max_tokens": 2}), 400, "prompt")
    _error(_post(server, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert httpx.get(f"{server.base_url}/v1/nowhere", headers=server.headers).status_code == 404
    _error(httpx.get(f"{server.base_url}/v1/completions", headers=server.headers), 405)


def test_huge_body_and_headers(server) -> None:
    _error(_post(server, "/v1/completions", {**CMPL, "prompt": "a" * 70000}), 413)
    big_header = {"x-filler": "a" * 9000}
    _error(httpx.get(f"{server.base_url}/v1/models", headers={**server.headers, **big_header}), 431)
    # Far beyond the limit, the HTTP parser refuses it (or drops the connection) before buffering it all.
    try:
        response = httpx.get(f"{server.base_url}/v1/models", headers={**server.headers, "x-filler": "a" * 200000})
        assert response.status_code in (400, 431)
    except httpx.TransportError:
        pass

    def chunks():
        for _ in range(20):
            yield b"a" * 8192
    response = httpx.post(f"{server.base_url}/v1/completions", content=chunks(),
                          headers={**server.headers, "content-type": "application/json"})
    _error(response, 413)  # chunked, so no content-length to check up front
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_auth(server) -> None:
    url = f"{server.base_url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {server.api_key}"},
                    {"Authorization": "Bearer"}, {"Authorization": f"Bearer {server.api_key}x"}):
        err = _error(httpx.get(url, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    for path in ("/openapi.json", "/metrics", "/version", "/tokenize", "/debug/engine", "/v1/nowhere"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401, path
    assert httpx.get(url, headers=server.headers).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200
