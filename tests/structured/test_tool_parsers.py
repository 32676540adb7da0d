"""Tool-call parsers on hand-written model outputs, whole and streamed through `ToolCallStream` in
arbitrary pieces (what a stream shows must add up to the same content and calls)."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.openai.tool_calls import ToolCallStream, ToolMode, merge_delta, parse_calls
from tokenmill.entrypoints.openai.tool_parsers import tool_call_parser

WEATHER = ("get_weather", {"city": "Paris", "days": 2})
ADD = ("add", {"a": 1, "b": 41})
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 41}}\n</tool_call>',
               "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 41}}', None),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 41}}]', "Sure."),
    "qwen3_xml": ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
                  "<parameter=a>\n1\n</parameter>\n<parameter=b>\n41\n</parameter>\n</function>\n</tool_call>",
                  "I will look."),
}


def calls_of(parsed):
    return [(name, json.loads(arguments)) for name, arguments in parsed.calls]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_parser_reads_hand_written_calls(name) -> None:
    text, content = OUTPUTS[name]
    parsed = tool_call_parser(name).parse(text)
    assert calls_of(parsed) == [WEATHER, ADD] and parsed.content == content


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_plain_text_is_content(name) -> None:
    parsed = tool_call_parser(name).parse("The weather in Paris is sunny.")
    assert parsed.calls == [] and parsed.content == "The weather in Paris is sunny."


def stream_deltas(mode: ToolMode, pieces: list[str]) -> list[dict]:
    """The delta of each piece (empty ones left out), then the finish's."""
    stream = ToolCallStream(mode)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    assert stream.has_calls == any("tool_calls" in d for d in deltas)
    return [d for d in deltas if d]


def client_assembly(deltas: list[dict]):
    """The message the official openai client assembles from these deltas (its own stream state)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk
    state = ChatCompletionStreamState()
    chunks = [{"role": "assistant", "content": ""}, *deltas]
    for i, delta in enumerate(chunks):
        last = i == len(chunks) - 1
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": "tool_calls" if last else None}]}))
    return state.get_final_completion().choices[0].message


def random_pieces(text: str, seed: int, count: int = 12) -> list[str]:
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), count))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("seed", range(3))
def test_streamed_pieces_add_up(name, seed) -> None:
    """Through the official client's own assembly: the whole answer's content and calls."""
    text, content = OUTPUTS[name]
    message = client_assembly(stream_deltas(ToolMode("auto", parser=tool_call_parser(name)), random_pieces(text, seed)))
    assert ((message.content or "").strip() or None) == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [WEATHER, ADD]
    assert [c.type for c in message.tool_calls] == ["function"] * 2
    assert all(c.id.startswith("call_") for c in message.tool_calls)


STREAMED = {**{name: ToolMode("auto", parser=tool_call_parser(name)) for name in sorted(OUTPUTS)},
            "required": ToolMode("required")}
REQUIRED_OUTPUT = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
                   '{"name": "add", "parameters": {"a": 1, "b": 41}}]')


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_call_arguments_stream_piece_by_piece(name) -> None:
    """JSON-format calls stream: each call's first delta has its index, id, type and name, and its
    arguments follow in several deltas, each arriving with the text that holds it."""
    text = REQUIRED_OUTPUT if name == "required" else OUTPUTS[name][0]
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    deltas = stream_deltas(STREAMED[name], pieces)
    entries = [(i, e) for i, d in enumerate(deltas) for e in d.get("tool_calls", [])]
    for index in (0, 1):
        mine = [(i, e) for i, e in entries if e["index"] == index]
        first = mine[0][1]
        assert first["type"] == "function" and first["id"].startswith("call_") and "name" in first["function"]
        assert all("id" not in e and "name" not in e["function"] for _, e in mine[1:])
        assert len(mine) >= 3, mine  # the arguments came in pieces, not in one delta at the end
        assert mine[-1][0] < len(deltas) - 1 or index == 1  # the first call ended before the stream did
    message = client_assembly(deltas)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [WEATHER, ADD]


def test_a_stream_holds_back_only_what_may_open_a_call() -> None:
    stream = ToolCallStream(ToolMode("auto", parser=tool_call_parser("hermes")))
    assert stream.feed("Hello <tool") == {"content": "Hello "}
    assert stream.feed("box> there") == {"content": "<toolbox> there"}
    assert stream.finish() == {} and not stream.has_calls


def test_named_and_required_modes() -> None:
    named = ToolCallStream(ToolMode("named", "add"))
    first, second = named.feed('{"a": 1,'), named.feed(' "b": 41}')
    assert first["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1,'}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ' "b": 41}'}}]}
    required = '[{"name": "add", "parameters": {"a": 1, "b": 41}}]'
    assert calls_of(parse_calls(ToolMode("required"), required)) == [ADD]
    assert parse_calls(ToolMode("required"), '[{"name": "add", "param') is None  # cut short: plain content


def test_llama3_json_needs_the_whole_output_to_be_calls() -> None:
    stream = ToolCallStream(ToolMode("auto", parser=tool_call_parser("llama3_json")))
    total = merge_delta(stream.feed("The answer is "), stream.feed('{"a": 1}'))
    total = merge_delta(total, stream.finish())
    assert total == {"content": 'The answer is {"a": 1}'} and not stream.has_calls


def test_without_parallel_tool_calls_auto_keeps_the_first_call() -> None:
    mode = ToolMode("auto", parser=tool_call_parser("hermes"), parallel=False)
    assert calls_of(parse_calls(mode, OUTPUTS["hermes"][0])) == [WEATHER]


@pytest.mark.parametrize("seed", range(3))
def test_streamed_calls_equal_the_whole_parse_on_awkward_json(seed) -> None:
    """Brackets and quotes inside strings, arguments before the name, arguments as a string of JSON,
    a call without arguments, a scalar argument value: the client's assembly of the stream (in
    random pieces, and one character at a time) equals the calls parsed from the whole text."""
    text = ('Hi.<tool_call>{"name": "echo", "arguments": {"text": "a \\"}\\" {[ b", "n": [1, {"x": "]"}]}}</tool_call>'
            '<tool_call>{"arguments": {"a": 1, "b": 41}, "name": "add"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "n", "arguments": 5}</tool_call>')
    mode = ToolMode("auto", parser=tool_call_parser("hermes"))
    want = [(name, json.loads(arguments)) for name, arguments in parse_calls(mode, text).calls]
    assert len(want) == 5
    for pieces in (random_pieces(text, seed, 30), list(text)):
        message = client_assembly(stream_deltas(mode, pieces))
        assert message.content == "Hi."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == want


def test_qwen3_xml_streams_parameter_by_parameter() -> None:
    """Values of every kind (a JSON object, a number, text with markup-like characters), a call
    without parameters: one character at a time, the client's assembly equals the whole parse."""
    text = ("Ok.\n<tool_call>\n<function=plan>\n<parameter=steps>\n{\"a\": [1, 2]}\n</parameter>\n"
            "<parameter=note>\nuse <b> & \"quotes\"\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>")
    mode = ToolMode("auto", parser=tool_call_parser("qwen3_xml"))
    want = [(name, json.loads(arguments)) for name, arguments in parse_calls(mode, text).calls]
    assert want == [("plan", {"steps": {"a": [1, 2]}, "note": 'use <b> & "quotes"', "n": 7}), ("now", {})]
    deltas = stream_deltas(mode, list(text))
    message = client_assembly(deltas)
    assert message.content == "Ok.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == want
    assert sum(1 for d in deltas for e in d.get("tool_calls", []) if e["index"] == 0) == 5  # name, 3 values, "}"
