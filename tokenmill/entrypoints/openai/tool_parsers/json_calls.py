"""Tool calls written as JSON objects, read as they stream: each call's name as soon as it is
complete, then its arguments' text piece by piece, as the official openai client assembles them.

The text fed is what follows the calls' opening marker. Call objects are top-level objects (hermes'
`<tool_call>{...}</tool_call>` blocks, llama3's `{...}; {...}`) or the objects of a top-level list
(mistral's `[{...}, {...}]`, `tool_choice: required`'s output); anything outside them (tags,
separators) is skipped. Within a call object, the value of "name" is the function's name and the
value of the first of `args_keys` present is its arguments: an object's text is passed on as it
arrives (the model's own spacing: the client joins the pieces, and they parse as the whole
answer's arguments do); a string holding JSON, or any other value, is passed on whole once it ends.
Arguments that come before the name wait for it. One character at a time, with the state kept
between feeds, so a stream costs O(its length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.entrypoints.openai.tool_parsers.base import arguments_text

_SPACE = " \t\r\n"


@dataclass
class _Call:
    name: str | None = None
    key: str | None = None  # the member being read
    expect: str = "key"  # key | colon | value | next (a member's value ended)
    token_start: int = -1  # where the current key or value began
    args_start: int = -1  # where the arguments' value began (an object or list, passed on as it comes)
    args_sent: int = -1  # how far the arguments' text has been passed on
    args_text: str | None = None  # the arguments once complete
    announced: bool = False


class JsonCallStream:
    """Feed text; each feed returns what became known: ("name", index, name) and ("args", index,
    text) events, in order."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.text = ""
        self.calls: list[_Call] = []
        self._pos = 0
        self._depth = 0  # open brackets
        self._in_string = False
        self._escape = False
        self._list = False  # the calls are the items of a top-level list
        self._member_depth = 0  # depth of the current call's members (0: no call open)
        self._scalar_start = -1  # a non-string, non-bracket value being read

    def feed(self, delta: str) -> list[tuple[str, int, str]]:
        self.text += delta
        events: list[tuple[str, int, str]] = []
        text = self.text
        while self._pos < len(text):
            self._step(text, self._pos, events)
            self._pos += 1
        call = self._current()
        if call is not None and call.args_start >= 0 and call.args_text is None:
            self._send_args(call, len(text), events)
        return events

    def _current(self) -> _Call | None:
        return self.calls[-1] if self._member_depth and self.calls else None

    def _step(self, text: str, i: int, events: list) -> None:
        ch = text[i]
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == self._member_depth:
                    self._end_token(text, i + 1, events)
            return
        call = self._current()
        if call is not None and self._depth == self._member_depth and self._scalar_start >= 0 and (
                ch in _SPACE or ch in ",}"):
            self._end_token(text, i, events)  # a number, true, false or null ended
        if ch == '"':
            self._in_string = True
            if call is not None and self._depth == self._member_depth:
                call.token_start = i
                if call.expect == "value":
                    call.expect = "string"
            return
        if ch in "{[":
            if call is not None and self._depth == self._member_depth and call.expect == "value":
                call.token_start = i
                call.expect = "bracket"
                if call.key in self.args_keys and call.args_text is None:
                    call.args_start = call.args_sent = i
            self._depth += 1
            if not self._member_depth:
                if ch == "[" and self._depth == 1:
                    self._list = True
                elif ch == "{" and self._depth == (2 if self._list else 1):
                    self._member_depth = self._depth
                    self.calls.append(_Call())
            return
        if ch in "}]":
            self._depth -= 1
            if call is None:
                if self._depth == 0:
                    self._list = False
                return
            if self._depth == self._member_depth and call.expect == "bracket":
                self._end_token(text, i + 1, events)
            elif self._depth < self._member_depth:  # the call object closed
                self._member_depth = 0
                self._close(call, events)
            return
        if call is None or self._depth != self._member_depth:
            return
        if ch == ":" and call.expect == "colon":
            call.expect = "value"
        elif ch == "," and call.expect == "next":
            call.expect = "key"
        elif ch not in _SPACE and call.expect == "value":
            call.token_start = i
            self._scalar_start = i
            call.expect = "scalar"

    def _end_token(self, text: str, end: int, events: list) -> None:
        """A key or a member's value ended at `end` (exclusive)."""
        call = self.calls[-1]
        self._scalar_start = -1
        piece = text[call.token_start:end]
        if call.expect == "key":
            call.key = _loads(piece)
            call.expect = "colon"
            return
        key, call.expect = call.key, "next"
        if key == "name" and call.name is None:
            name = _loads(piece)
            if isinstance(name, str):
                call.name = name
                self._announce(call, events)
        elif key in self.args_keys and call.args_text is None:
            if call.args_start >= 0:
                call.args_text = piece
                self._send_args(call, end, events)
            else:  # a string of JSON, or a scalar: whole
                value = _loads(piece)
                call.args_text = arguments_text(value)
                if call.announced:
                    events.append(("args", len(self.calls) - 1, call.args_text))

    def _announce(self, call: _Call, events: list) -> None:
        call.announced = True
        index = len(self.calls) - 1
        events.append(("name", index, call.name))
        if call.args_start >= 0:  # arguments came first: what arrived of them
            self._send_args(call, call.args_start + len(call.args_text) if call.args_text is not None
                            else len(self.text), events)
        elif call.args_text is not None:
            events.append(("args", index, call.args_text))

    def _send_args(self, call: _Call, upto: int, events: list) -> None:
        if call.announced and upto > call.args_sent:
            events.append(("args", self.calls.index(call), self.text[call.args_sent:upto]))
            call.args_sent = upto

    def _close(self, call: _Call, events: list) -> None:
        if call.announced and call.args_text is None and call.args_start < 0:
            call.args_text = "{}"  # a call without arguments
            events.append(("args", len(self.calls) - 1, "{}"))


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
