"""Structured outputs and tool calling through the official openai client, against a real
`tokenmill serve` of SmolLM2 on the CPU (async scheduling on): every answer parses and validates,
streamed and not, and ends with `stop`; forced tool calls have valid arguments; `auto` with the
hermes parser reads a hand-written call; streamed tool calls arrive as the client expects them
(id, type and name first, then the arguments in pieces); bad constraints get a 400 and the server
keeps serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.requirements import require_smollm2
from tests.server.conftest import start_server, stop_server

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"]}}, "required": ["person"]},
    "bounded_array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"]},
    "enum_and_range": {"type": "object", "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 3, "maximum": 9},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["size", "count", "ratio"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]}},
        "required": ["value"]},
    "ref": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_smollm2()
    srv = start_server("smollm2", tmp_path_factory.mktemp("structured-server"), "--dtype", "float32",
                       "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--public-metrics", api_key=None, timeout_s=180)
    yield srv
    assert stop_server(srv) == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def _chat(client, stream: bool, **kwargs):
    """(content, tool_calls, finish_reason), streamed through the client's own assembly or not."""
    args = {"model": "smollm2", "messages": ASK, "temperature": 0, "max_tokens": 80, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.message.tool_calls, choice.finish_reason
    with client.chat.completions.stream(**args) as events:
        deltas = [e.chunk.choices[0].delta for e in events if e.type == "chunk" and e.chunk.choices]
        choice = events.get_final_completion().choices[0]
    if choice.message.tool_calls:
        _check_incremental(deltas)
    return choice.message.content, choice.message.tool_calls, choice.finish_reason


def _check_incremental(deltas) -> None:
    """Each tool call streams: its first delta has the id, type and name; its arguments follow in
    more than one delta (not once at the end)."""
    entries = [e for d in deltas for e in (d.tool_calls or [])]
    for index in sorted({e.index for e in entries}):
        mine = [e for e in entries if e.index == index]
        assert mine[0].id and mine[0].type == "function" and mine[0].function.name, mine[0]
        assert all(e.id is None and e.function.name is None for e in mine[1:]), mine
        assert sum(bool(e.function.arguments) for e in mine) >= 2, f"arguments in one piece: {mine}"


def test_json_schemas_validate_streamed_and_not(client) -> None:
    jobs = [(name, stream) for name in SCHEMAS for stream in (False, True)]

    def run(job):
        name, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        prompt = [{"role": "user", "content": f"Answer with a JSON object ({name})."}]
        return _chat(client, stream, messages=prompt, response_format=fmt, max_tokens=120)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (name, stream), (content, _, finish) in zip(jobs, results):
        assert finish == "stop", (name, stream, content)
        jsonschema.validate(json.loads(content), SCHEMAS[name])


def test_json_object_regex_and_choice(client) -> None:
    short = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    content, _, finish = _chat(client, False, messages=short, response_format={"type": "json_object"}, max_tokens=120)
    assert finish == "stop" and isinstance(json.loads(content), dict)
    pattern = r"[A-Z]{2}-\d{3}"
    out = client.completions.create(model="smollm2", prompt="A part number:", max_tokens=20, temperature=0.9, seed=3,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["sunny", "rainy", "snowy"]
    for stream in (False, True):
        content, _, finish = _chat(client, stream, extra_body={"structured_outputs": {"choice": choices}})
        assert content in choices and finish == "stop"


def test_named_and_required_tool_calls_have_valid_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        content, calls, finish = _chat(client, stream, tools=TOOLS, tool_choice=named)
        assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        assert calls[0].id.startswith("call_")
        content, calls, finish = _chat(client, stream, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120)
        assert finish == "tool_calls" and len(calls) == 1, content
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == calls[0].function.name)
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_auto_reads_a_hand_written_hermes_call(client) -> None:
    """The output is forced (a one-choice constraint) to a hand-written hermes call; `auto` parses it."""
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    for stream in (False, True):
        content, calls, finish = _chat(client, stream, tools=TOOLS, tool_choice="auto",
                                       extra_body={"structured_outputs": {"choice": [written]}})
        assert finish == "tool_calls" and not content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 2})]
    # A tool's result goes back through the template; plain text stays content.
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    content, calls, finish = _chat(client, False, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert calls is None and content and finish in ("stop", "length")


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "invalid regular expression"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"json": {"type": "string", "description": "x" * 70000}}}, "more than the limit"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
])
def test_bad_constraints_get_400_and_the_server_keeps_serving(server, body, words) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": "smollm2", "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    ok = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                    json={"model": "smollm2", "messages": ASK, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_metrics_count_constrained_requests_and_compile_time(server, client) -> None:
    _chat(client, False, extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    count = re.search(r'^tokenmill:structured_output_requests_total\{[^}]*\} (\S+)$', text, re.M)
    compiled = re.search(r'^tokenmill:grammar_compile_seconds_count\{[^}]*\} (\S+)$', text, re.M)
    assert count and float(count.group(1)) >= 1 and compiled and float(compiled.group(1)) >= 1


def test_bench_serve_sends_a_structured_workload(server, tmp_path, capsys) -> None:
    from tokenmill.cli import main
    record_path = tmp_path / "record.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--endpoint", "/v1/chat/completions",
                 "--num-prompts", "3", "--input-len", "4", "--output-len", "12", "--structured", "choice",
                 "--output-json", str(record_path)])
    assert code == 0, capsys.readouterr().out
    run = json.loads(record_path.read_text())["runs"][0]
    assert run["completed"] == 3 and run["failed"] == 0
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert float(re.search(r'^tokenmill:structured_output_requests_total\{[^}]*\} (\S+)$', text, re.M).group(1)) >= 3
