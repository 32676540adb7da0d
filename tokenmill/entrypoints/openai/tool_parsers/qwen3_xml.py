"""Qwen3-Coder XML style:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value that parses as JSON is taken as such (numbers, objects, true); any other is a string.
A stream (`XmlCallStream`) sends a call's name once its `<function=...>` tag is complete, then its
arguments object one complete parameter at a time (`{"city": "Paris"`, `, "days": 2`, `}`)."""

from __future__ import annotations

import json
import re

from tokenmill.entrypoints.openai.tool_parsers.base import ParsedToolCalls, ToolCallParser, content_or_none

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_FUNCTION_OPEN = re.compile(r"<function=([^>\s]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3XmlParser(ToolCallParser):
    starts = ("<tool_call>",)

    def call_stream(self) -> XmlCallStream:
        return XmlCallStream()

    def parse(self, text: str) -> ParsedToolCalls:
        at = self.find_start(text)
        if at < 0:
            return ParsedToolCalls(content_or_none(text))
        calls = []
        for name, body in _FUNCTION.findall(text[at:]):
            arguments = {key: _value(value) for key, value in _PARAMETER.findall(body)}
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return ParsedToolCalls(content_or_none(text))
        return ParsedToolCalls(content_or_none(text[:at]), calls)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class XmlCallStream:
    """Feed the text after the calls' opening marker; each feed returns ("name", index, name) and
    ("args", index, text) events (json_calls.py's), for what became complete."""

    def __init__(self) -> None:
        self.text = ""
        self._pos = 0  # everything before it is read
        self._calls = 0  # calls closed
        self._params = -1  # parameters of the open call (-1: no call open)

    def feed(self, delta: str) -> list[tuple[str, int, str]]:
        self.text += delta
        events: list[tuple[str, int, str]] = []
        while True:
            if self._params < 0:
                opened = _FUNCTION_OPEN.search(self.text, self._pos)
                if opened is None:
                    return events
                events.append(("name", self._calls, opened.group(1)))
                self._params, self._pos = 0, opened.end()
                continue
            parameter = _PARAMETER.search(self.text, self._pos)
            end = self.text.find("</function>", self._pos)
            if parameter is not None and (end < 0 or parameter.start() < end):
                key, value = parameter.groups()
                head = "{" if self._params == 0 else ", "
                events.append(("args", self._calls, head + json.dumps(key, ensure_ascii=False) + ": "
                               + json.dumps(_value(value), ensure_ascii=False)))
                self._params += 1
                self._pos = parameter.end()
            elif end >= 0:
                events.append(("args", self._calls, "}" if self._params else "{}"))
                self._calls += 1
                self._params, self._pos = -1, end + len("</function>")
            else:
                return events
