"""Chat messages -> prompt text and token ids, with the model's own chat template only."""

from __future__ import annotations

import inspect
from typing import Any

import jinja2

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.schemas import ChatMessage


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


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, kwargs: dict[str, Any] | None) -> tuple[str, list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    extra = dict(kwargs or {})
    bad = sorted(k for k in extra if k in reserved_kwargs(tokenizer) or not k.isidentifier())
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)[:200]}",
                       param="chat_template_kwargs")
    conversation = [{"role": m.role, "content": _content(m), **({"name": m.name} if m.name else {})}
                    for m in messages]
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the chat template rejected these messages: {str(exc)[:300]}",
                       param="messages") from None
    except Exception:  # noqa: BLE001 - a template failing on odd input is the request's problem
        raise APIError(400, "the chat template could not render these messages", param="messages") from None
    if not isinstance(text, str):
        raise APIError(400, "the chat template could not render these messages", param="messages")
    return text, tokenizer(text, add_special_tokens=False).input_ids
