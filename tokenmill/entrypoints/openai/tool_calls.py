"""Tool calling in chat completions: which mode a request asks for, the constraint that makes a
forced call valid, and the calls read back from the output (whole, or as stream deltas).

- `none` (or no tools): plain text; the tools are not shown to the template.
- a named function: the output is that function's arguments, constrained by its JSON schema.
- `required`: the output is a JSON list of `{"name", "parameters"}` (one item without
  `parallel_tool_calls`), each constrained by its function's schema (as vLLM does).
- `auto`: the model writes calls in its own syntax, read by `--tool-call-parser`; only with
  `--enable-auto-tool-choice` (without it `auto` is `none`, unless the flag is required below).
A choice that ends with `stop` and holds calls ends with `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.schemas import ChatCompletionRequest, NamedToolChoice
from tokenmill.entrypoints.openai.tool_parsers import ParsedToolCalls, ToolCallParser, tool_call_parser
from tokenmill.entrypoints.openai.tool_parsers.json_calls import JsonCallStream
from tokenmill.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolMode:
    kind: str  # none | named | required | auto
    name: str | None = None  # the named function
    parser: ToolCallParser | None = None  # auto
    parallel: bool = True  # auto: several calls kept (else the first only)


def tool_mode(req: ChatCompletionRequest, settings: ServerSettings) -> ToolMode:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolMode("none")
    if choice == "none":
        return ToolMode("none")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in req.tools}:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        return ToolMode("named", choice.function.name)
    if choice == "required":
        return ToolMode("required")
    if choice == "auto" and not settings.enable_auto_tool_choice:
        raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                            '--tool-call-parser', param="tool_choice")
    if not settings.enable_auto_tool_choice:
        return ToolMode("none")  # tools given, no choice, no parser: they only reach the template
    return ToolMode("auto", parser=tool_call_parser(settings.tool_call_parser), parallel=req.parallel_tool_calls)


def template_tools(req: ChatCompletionRequest, mode: ToolMode) -> list[dict] | None:
    """The tools as the chat template takes them (OpenAI's shape)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def tool_constraint(req: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputsParams | None:
    """The JSON schema a forced call's output follows (None for none and auto)."""
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools or ()}
    if mode.kind == "named":
        return StructuredOutputsParams(json=schemas[mode.name])
    if mode.kind != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"]} for name, schema in schemas.items()]
    array = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def parse_calls(mode: ToolMode, text: str) -> ParsedToolCalls | None:
    """The calls in a finished choice's text; None when the mode makes none (plain content)."""
    if mode.kind == "named":
        return ParsedToolCalls(None, [(mode.name, text)])
    if mode.kind == "required":
        try:
            items = json.loads(text)
            return ParsedToolCalls(None, [(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                                          for item in items])
        except (json.JSONDecodeError, KeyError, TypeError):
            return None  # cut short (max_tokens): the text as it is
    if mode.kind == "auto":
        parsed = mode.parser.parse(text)
        if not mode.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed if parsed.calls else None
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(parsed: ParsedToolCalls) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in parsed.calls]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolCallStream:
    """One choice's stream: text deltas in, OpenAI delta fields out (`content`, `tool_calls`), as
    the official client assembles them: a call's first delta has its index, id, type and name,
    later ones add to its arguments. Named calls stream their arguments as they are generated;
    `required` calls and `auto` calls in a JSON format (hermes, llama3_json, mistral) stream each
    call's name once complete, then its arguments piece by piece (tool_parsers/json_calls.py);
    qwen3_xml calls stream their name, then their arguments one parameter at a time."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.has_calls = False
        self._shown = 0  # characters of `text` shown as content so far
        self._in_calls = False  # auto: the calls began; the rest waits for the end
        self._named_id: str | None = None
        self._json = None  # JsonCallStream / XmlCallStream: required, or auto with a streaming parser
        self._ids: list[str] = []  # ids of the calls announced so far
        if mode.kind == "required":
            self._json = JsonCallStream(("parameters",))

    def feed(self, delta: str) -> dict:
        self.text += delta
        kind = self.mode.kind
        if kind == "none":
            return {"content": delta} if delta else {}
        if kind == "named":
            if self._named_id is None:
                self._named_id = call_id()
                self.has_calls = True
                return {"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                        "function": {"name": self.mode.name, "arguments": delta}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}
        if self._json is not None:
            return self._calls(self._json.feed(delta))
        if kind == "required" or self._in_calls:
            return {}
        parser = self.mode.parser
        at = parser.find_start(self.text)
        if at >= 0:  # the calls begin: show the text before them; JSON calls stream from here
            self._in_calls = True
            shown = self._show(at)
            self._json = parser.call_stream()
            if self._json is not None:
                shown = merge_delta(shown, self._calls(self._json.feed(self.text[parser.json_from(self.text, at):])))
            return shown
        return self._show(len(self.text) - parser.held_back(self.text[self._shown:]))

    def _calls(self, events: list[tuple[str, int, str]]) -> dict:
        """Call events (json_calls.py) as `tool_calls` delta entries, one per call and feed."""
        entries: dict[int, dict] = {}
        for what, index, value in events:
            if index > 0 and not self.mode.parallel:
                continue  # auto without parallel_tool_calls: the first call only
            if what == "name":
                self._ids.append(call_id())
                self.has_calls = True
                entries[index] = {"index": index, "id": self._ids[index], "type": "function",
                                  "function": {"name": value, "arguments": ""}}
            else:
                entry = entries.setdefault(index, {"index": index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += value
        return {"tool_calls": list(entries.values())} if entries else {}

    def _show(self, upto: int) -> dict:
        """The text not shown yet, up to `upto`, as a content delta."""
        shown, self._shown = self.text[self._shown:upto], max(self._shown, upto)
        return {"content": shown} if shown else {}

    def finish(self) -> dict:
        """The choice ended: what was held back, or the calls not streamed yet."""
        if self.mode.kind in ("none", "named"):
            return {}
        if self.mode.kind == "auto" and not self._in_calls:
            return self._show(len(self.text))
        parsed = parse_calls(self.mode, self.text)
        if parsed is None and not self._ids:  # no calls after all: the text it held back
            return self._show(len(self.text))
        streamed = len(self._ids)
        calls = message_calls(parsed)[streamed:] if parsed is not None else []
        if calls:
            self.has_calls = True
        return {"tool_calls": [{"index": streamed + i, **call} for i, call in enumerate(calls)]} if calls else {}


def merge_delta(a: dict, b: dict) -> dict:
    """Two delta field sets as one (contents joined, tool-call lists concatenated)."""
    out = dict(a)
    if "content" in b:
        out["content"] = out.get("content", "") + b["content"]
    if "tool_calls" in b:
        out["tool_calls"] = out.get("tool_calls", []) + b["tool_calls"]
    return out
