"""What every tool-call parser gives: the text before the calls, and the calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ParsedToolCalls:
    content: str | None  # text outside the calls (None when there is none)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments as JSON text)


class ToolCallParser:
    """`starts` are the texts that open the model's tool calls: a stream shows text until one
    appears (holding back a tail that could begin one), then waits for the end to parse the calls."""

    starts: tuple[str, ...] = ()
    # Keys of a call object's arguments, for formats whose calls are JSON objects (streamed as they
    # come: json_calls.py); None: the calls are read whole once the output ends.
    args_keys: tuple[str, ...] | None = None

    def parse(self, text: str) -> ParsedToolCalls:
        raise NotImplementedError

    def find_start(self, text: str) -> int:
        """Where the calls begin in `text` (-1: not yet)."""
        found = [at for at in (text.find(start) for start in self.starts) if at >= 0]
        return min(found, default=-1)

    def call_stream(self):
        """A reader of the calls as they stream (fed the text after `json_from`), or None: the
        calls are read whole when the output ends."""
        if self.args_keys is None:
            return None
        from tokenmill.entrypoints.openai.tool_parsers.json_calls import JsonCallStream
        return JsonCallStream(self.args_keys)

    def json_from(self, text: str, at: int) -> int:
        """Where the calls' text begins, given that they begin at `at`: after the opening marker
        unless the marker is JSON itself."""
        for start in self.starts:
            if text.startswith(start, at):
                return at if start.startswith(("{", "[")) else at + len(start)
        return at

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could begin a start (a stream holds them back)."""
        for n in range(min(max(map(len, self.starts)) - 1, len(text)), 0, -1):
            if any(start.startswith(text[-n:]) for start in self.starts):
                return n
        return 0


def arguments_text(arguments) -> str:
    """A call's arguments as JSON text (models write them as an object, or as a string of JSON)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def content_or_none(text: str) -> str | None:
    text = text.strip()
    return text or None
