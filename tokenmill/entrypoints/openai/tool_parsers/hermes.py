"""Hermes / Qwen 2.5 style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json
import re

from tokenmill.entrypoints.openai.tool_parsers.base import (ParsedToolCalls, ToolCallParser, arguments_text,
                                                             content_or_none)

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolCallParser):
    starts = ("<tool_call>",)
    args_keys = ("arguments",)

    def parse(self, text: str) -> ParsedToolCalls:
        at = self.find_start(text)
        if at < 0:
            return ParsedToolCalls(content_or_none(text))
        calls = []
        for body in _CALL.findall(text[at:]):
            try:
                call = json.loads(body.strip())
            except json.JSONDecodeError:
                return ParsedToolCalls(content_or_none(text))  # not a call after all: plain text
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ParsedToolCalls(content_or_none(text))
            calls.append((call["name"], arguments_text(call.get("arguments"))))
        return ParsedToolCalls(content_or_none(text[:at]), calls)
