"""The app on a real in-process engine: each prompt is checked once (the route prepares it, the
engine generates the prepared request), a client's bad input is a 400, and a server bug is a
500 whose traceback is logged (chat templates, output processing)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from tests.helpers.request_checks import count_request_checks
from tokenmill.entrypoints.openai.app import build_app
from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.detokenizer import IncrementalDetokenizer

USER = [{"role": "user", "content": "hi"}]
# Renders the first message's content plus a number: a bug in the template, whatever the request.
TYPE_ERROR_TEMPLATE = "{{ messages[0]['content'] + 1 }}"
REJECTING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('system messages are not supported') }}{% endif %}"
                      "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    engine = AsyncLLM(tiny_chat_model, dtype="float32", kv_cache_memory_gb=0.01, single_process=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, ServerSettings()), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def checks(monkeypatch) -> dict[str, int]:
    return count_request_checks(monkeypatch)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_each_prompt_is_checked_once(client, checks) -> None:
    response = client.post("/v1/completions", json={"prompt": ["one", "two"], "n": 2, "max_tokens": 3})
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
    assert checks == {"validate": 2, "tokenize": 2}
    response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "stream": True})
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert checks == {"validate": 3, "tokenize": 3}


def test_template_rejecting_the_messages_is_a_400(client, engine, monkeypatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", REJECTING_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"}, *USER]
    err = error_of(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}), 400)
    assert err["param"] == "messages" and "system messages are not supported" in err["message"]
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200
    # Continuing a final message the template drops: transformers' own check, also the request's problem.
    cont = {"messages": [*USER, {"role": "assistant", "content": "sure"}], "max_tokens": 2,
            "continue_final_message": True, "add_generation_prompt": False}
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{% for m in messages %}{{ m['role'] }}\n{% endfor %}")
    assert error_of(client.post("/v1/chat/completions", json=cont), 400)["param"] == "continue_final_message"


def test_template_bug_is_a_logged_500(client, engine, monkeypatch, caplog) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", TYPE_ERROR_TEMPLATE)
    with caplog.at_level(logging.ERROR, logger="tokenmill.entrypoints.openai.errors"):
        response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    err = error_of(response, 500)
    assert err["code"] == "internal_error" and "Traceback" not in err["message"]
    assert_logged(caplog, TypeError)


def test_output_processing_bug_is_a_logged_500(client, engine, monkeypatch, caplog) -> None:
    def broken_push(self, token_id: int) -> str:
        raise RuntimeError("detokenizer bug")

    monkeypatch.setattr(IncrementalDetokenizer, "push", broken_push)
    body = {"prompt": "hi", "max_tokens": 3}
    with caplog.at_level(logging.ERROR):
        err = error_of(client.post("/v1/completions", json=body), 500)
        assert err["code"] == "internal_error" and "detokenizer bug" not in err["message"]
        events = client.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "internal_error"
    assert_logged(caplog, RuntimeError)
    monkeypatch.undo()
    assert client.post("/v1/completions", json=body).status_code == 200  # the engine lives on
    stats = client.portal.call(engine.kv_cache_stats)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def assert_logged(caplog, exc_type: type[BaseException]) -> None:
    """An ERROR record carrying an `exc_type` with its traceback."""
    assert any(r.levelno >= logging.ERROR and r.exc_info and isinstance(r.exc_info[1], exc_type)
               and r.exc_info[2] is not None for r in caplog.records), [r.getMessage() for r in caplog.records]
