"""Parsers of a model's own tool-call syntax (`--tool-call-parser`, with `tool_choice: auto`), one
module per format, with vLLM's names."""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.base import ParsedToolCalls, ToolCallParser


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser called `name`; ValueError naming the flag for an unknown one."""
    if name == "hermes":
        from tokenmill.entrypoints.openai.tool_parsers.hermes import HermesParser
        return HermesParser()
    if name == "llama3_json":
        from tokenmill.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonParser
        return Llama3JsonParser()
    if name == "mistral":
        from tokenmill.entrypoints.openai.tool_parsers.mistral import MistralParser
        return MistralParser()
    if name == "qwen3_xml":
        from tokenmill.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlParser
        return Qwen3XmlParser()
    raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")


PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
__all__ = ["PARSERS", "ParsedToolCalls", "ToolCallParser", "tool_call_parser"]
