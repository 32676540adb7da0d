"""Qwen3-Coder XML style:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value that parses as JSON is taken as such (numbers, objects, true); any other is a string."""

from __future__ import annotations

import json
import re

from tokenmill.entrypoints.openai.tool_parsers.base import ParsedToolCalls, ToolCallParser, content_or_none

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3XmlParser(ToolCallParser):
    starts = ("<tool_call>",)

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
