"""Chat messages -> a prompt, with the model's own chat template only.

A template that rejects the messages (jinja2's TemplateError, which its `raise_exception`
raises too), or drops the final message a request asks to continue (transformers' ValueError),
is the request's problem: a 400. Anything else a template raises is a bug, in the template
or here: it propagates to the server's handler, a logged 500.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import jinja2

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.schemas import ChatMessage
from tokenmill.frontend.engine_frontend import EngineFrontend


def _content(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def reserved_kwargs(tokenizer) -> frozenset[str]:
    """apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
    (one of them is `chat_template`, which would let a request supply its own template)."""
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) | {"chat_template"}


def _message(m: ChatMessage) -> dict:
    """A message as chat templates take it: an assistant's tool calls with their arguments as objects
    (what templates write out), a tool's result with the id of the call it answers."""
    message: dict[str, Any] = {"role": m.role, "content": _content(m), **({"name": m.name} if m.name else {})}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(text: str):
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text


def render_chat(frontend: EngineFrontend, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, kwargs: dict[str, Any] | None, tools: list[dict] | None = None) -> dict:
    """The conversation as a prompt for `frontend.prepare` (its text and token ids)."""
    tokenizer = frontend.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    extra = dict(kwargs or {})
    bad = sorted(k for k in extra if k in reserved_kwargs(tokenizer) or not k.isidentifier())
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)[:200]}",
                       param="chat_template_kwargs")
    conversation = [_message(m) for m in messages]
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    try:
        return frontend.chat_prompt(conversation, add_generation_prompt, continue_final_message, extra, tools)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the chat template rejected these messages: {str(exc)[:300]}",
                       param="messages") from None
    except ValueError:
        if not continue_final_message:
            raise
        # transformers' own check: the template dropped the message it was asked to continue.
        raise APIError(400, "continue_final_message: the chat template does not keep the final message, "
                            "so it cannot be continued", param="continue_final_message") from None
