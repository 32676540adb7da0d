"""In-process app on an engine that dies mid-request: /health 503, the stream ends with an error
event then [DONE], and no message leaks the engine's internals."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.openai.app import build_app
from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.engine_frontend import EngineFrontend
from tokenmill.outputs import CompletionOutput, RequestOutput


class DyingEngine:
    """AsyncLLM's face: one token's output, then the engine is gone."""

    def __init__(self, model_dir: str) -> None:
        self.frontend = EngineFrontend(EngineArgs(model=model_dir, dtype="float32"))  # never started
        self.config, self.tokenizer = self.frontend.config, self.frontend.tokenizer

    async def generate(self, prompt, sampling_params=None, request_id=None):
        yield RequestOutput(request_id, prompt.prompt, prompt.prompt_token_ids,
                            [CompletionOutput(0, "ab", [100, 101])], False)
        raise EngineDeadError("worker 0 died; see /tmp/secret/trace.log")

    async def scheduler_stats(self):
        raise EngineDeadError("the engine core died")

    dead_error = None  # not known dead until asked (the health check's round trip finds out)

    def stalled_for(self) -> float:
        return 0.0

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def client(tiny_chat_model) -> TestClient:
    return TestClient(build_app(DyingEngine(tiny_chat_model), ServerSettings()), raise_server_exceptions=False)


def test_health_is_503_when_the_engine_is_dead(client) -> None:
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert client.get("/metrics").status_code == 200  # front-end figures are still served


def test_error_after_streaming_began_is_an_event_then_done(client) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "ab"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "/tmp" not in error["message"]


def test_non_streaming_request_on_a_dead_engine_is_503(client) -> None:
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 4})
    assert response.status_code == 503
    assert response.json()["error"] == {"message": "the engine is not running", "type": "service_unavailable_error",
                                        "param": None, "code": "engine_dead"}
    assert client.app.state.tokenmill.admission.num_seqs == 0  # released however the request ended
