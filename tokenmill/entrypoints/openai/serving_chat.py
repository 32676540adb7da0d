"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.chat_template import render_chat
from tokenmill.entrypoints.openai.generation import ChoiceDelta, Generation
from tokenmill.entrypoints.openai.limits import check_chat_request, sampling_params
from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.schemas import ChatCompletionRequest, ChatCompletionResponse, ErrorResponse
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.serving_common import check_grammar, new_id, now_s, prepare, run_to_end, stream, usage
from tokenmill.entrypoints.openai.tool_calls import (ToolCallStream, finish_reason, merge_delta, message_calls,
                                                     parse_calls, template_tools, tool_constraint, tool_mode)
from tokenmill.entrypoints.openai.state import get_state

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                        503: {"model": ErrorResponse}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    lora = state.check_model(body.model)
    check_chat_request(body, state.settings)
    mode = tool_mode(body, state.settings)
    chat = render_chat(state.frontend, body.messages, body.add_generation_prompt, body.continue_final_message,
                       body.chat_template_kwargs, template_tools(body, mode))
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, requested, k)
    forced = tool_constraint(body, mode)
    if forced is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {mode.kind!r} constrains the output: response_format and "
                                f"structured_outputs cannot be used with it", param="tool_choice")
        params.structured_outputs = forced
    # The engine's logprobs are what this API calls top_logprobs.
    aliases = {"logprobs": "top_logprobs"}
    await check_grammar(state, params, aliases)
    prompt = prepare(state, chat, params, "messages", aliases, lora=lora)
    request_id, created = new_id("chatcmpl"), now_s()
    gen = Generation(state.engine, request_id, [prompt], body.n, state.metrics)
    head = {"id": request_id, "created": created, "model": state.response_model(lora)}

    if not body.stream:
        def render() -> dict:
            choices = []
            for c in gen.choices:
                parsed = parse_calls(mode, c.text)
                message = {"role": "assistant", "content": c.text}
                if parsed is not None:
                    message = {"role": "assistant", "content": parsed.content, "tool_calls": message_calls(parsed)}
                choices.append({"index": c.index, "message": message,
                                "logprobs": {"content": chat_logprobs(c.logprobs, k)} if k is not None else None,
                                "finish_reason": finish_reason(c.finish_reason, parsed is not None),
                                "stop_reason": c.stop_reason})
            return {**head, "object": "chat.completion", "choices": choices, "usage": usage(gen)}
        return await run_to_end(request, state, gen, render)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    prelude = [{**chunk_head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **extra}
               for c in gen.choices]

    tool_streams = {c.index: ToolCallStream(mode) for c in gen.choices}

    def render_step(deltas: list[ChoiceDelta]) -> list[dict]:
        choices = []
        for d in deltas:
            calls = tool_streams[d.choice.index]
            delta = calls.feed(d.text)
            if d.finish_reason is not None:
                delta = merge_delta(delta, calls.finish())
            if not delta and not d.logprobs and d.finish_reason is None:
                continue
            choices.append({"index": d.choice.index, "delta": delta,
                            "logprobs": {"content": chat_logprobs(d.logprobs, k)} if k is not None else None,
                            "finish_reason": finish_reason(d.finish_reason, calls.has_calls),
                            "stop_reason": d.choice.stop_reason if d.finish_reason else None})
        return [{**chunk_head, "choices": choices, **extra}] if choices else []

    def render_usage() -> dict:
        return {**chunk_head, "choices": [], "usage": usage(gen)}

    return stream(state, gen, render_step, render_usage if include_usage else None, prelude)
