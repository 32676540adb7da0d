"""Llama 3.x JSON style: `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several calls separated by `;`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.openai.tool_parsers.base import (ParsedToolCalls, ToolCallParser, arguments_text,
                                                             content_or_none)


class Llama3JsonParser(ToolCallParser):
    starts = ("<|python_tag|>", "{")
    args_keys = ("parameters", "arguments")

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        if not body.startswith("{"):
            return ParsedToolCalls(content_or_none(text))
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                call, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedToolCalls(content_or_none(text))
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ParsedToolCalls(content_or_none(text))
            calls.append((call["name"], arguments_text(call.get("parameters", call.get("arguments")))))
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return ParsedToolCalls(None, calls)

    def find_start(self, text: str) -> int:
        """A call is the whole output: it begins where the output does, with "{" or the tag."""
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(self.starts) else -1

    def held_back(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if body and self.starts[0].startswith(body) else 0
