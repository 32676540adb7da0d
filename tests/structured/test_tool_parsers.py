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


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("seed", range(3))
def test_streamed_pieces_add_up(name, seed) -> None:
    text, content = OUTPUTS[name]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ToolCallStream(ToolMode("auto", parser=tool_call_parser(name)))
    total: dict = {}
    for piece in pieces:
        total = merge_delta(total, stream.feed(piece))
    total = merge_delta(total, stream.finish())
    assert (total.get("content", "").strip() or None) == content
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in total["tool_calls"]]
    assert calls == [WEATHER, ADD]
    assert [c["index"] for c in total["tool_calls"]] == [0, 1] and all(c["id"] for c in total["tool_calls"])
    assert stream.has_calls


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
