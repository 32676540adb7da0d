"""Mistral style: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.openai.tool_parsers.base import (ParsedToolCalls, ToolCallParser, arguments_text,
                                                             content_or_none)


class MistralParser(ToolCallParser):
    starts = ("[TOOL_CALLS]",)
    args_keys = ("arguments",)

    def parse(self, text: str) -> ParsedToolCalls:
        at = self.find_start(text)
        if at < 0:
            return ParsedToolCalls(content_or_none(text))
        try:
            calls, _ = json.JSONDecoder().raw_decode(text[at + len(self.starts[0]):].lstrip())
        except json.JSONDecodeError:
            return ParsedToolCalls(content_or_none(text))
        if isinstance(calls, dict):
            calls = [calls]
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  for c in calls):
            return ParsedToolCalls(content_or_none(text))
        return ParsedToolCalls(content_or_none(text[:at]),
                               [(c["name"], arguments_text(c.get("arguments"))) for c in calls])
