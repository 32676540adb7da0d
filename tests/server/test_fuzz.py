"""Fuzzing the API with bodies generated from its own pydantic schemas (hypothesis-jsonschema),
mutated with arbitrary JSON: never a 500, never a crash, the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.requirements import require_module
from tokenmill.entrypoints.openai import schemas

ENDPOINTS = {
    "/v1/completions": schemas.CompletionRequest,
    "/v1/chat/completions": schemas.ChatCompletionRequest,
    "/tokenize": schemas.TokenizeCompletionRequest,
    "/detokenize": schemas.DetokenizeRequest,
}
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)


def _schema(model) -> dict:
    schema = model.model_json_schema()
    schema.setdefault("additionalProperties", False)  # keep bodies about the API's own fields
    return schema


def _bodies(path: str) -> st.SearchStrategy:
    valid = require_module("hypothesis_jsonschema").from_schema(_schema(ENDPOINTS[path]))
    mutated = st.tuples(valid, st.sampled_from(sorted(ENDPOINTS[path].model_fields)), _JSON).map(
        lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, valid, mutated, _JSON)


def _keep_it_short(body):
    """Long generations would only slow the test down; lengths are probed in test_limits."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 8):
                body[key] = 4
    return body


CASES = st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda p: st.tuples(st.just(p), _bodies(p).map(_keep_it_short)))


def test_fuzz_api_from_schema(server) -> None:
    require_module("hypothesis_jsonschema")  # a test extra: skipped locally if absent, a failure in CI
    client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
    statuses: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(CASES)
    def one_case(case) -> None:
        path, body = case
        content = json.dumps(body, allow_nan=True).encode()
        response = client.post(path, content=content, headers={"content-type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, body, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["message"] and error["type"]
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        else:
            response.json()

    one_case()
    assert statuses.get(200, 0) >= 20, statuses  # the fuzz reached generation, not only validation
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "still alive", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stats = server.wait_engine_idle()
    assert stats["kv_cache"]["num_requests"] == 0 and stats["admitted_sequences"] == 0, stats
