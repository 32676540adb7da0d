"""POST /v1/completions: text (or token-id) prompts, streamed as SSE or answered whole."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.generation import ChoiceDelta, Generation
from tokenmill.entrypoints.openai.limits import check_completion_request, sampling_params
from tokenmill.entrypoints.openai.logprobs import completion_logprobs
from tokenmill.entrypoints.openai.schemas import CompletionRequest, CompletionResponse, ErrorResponse
from tokenmill.entrypoints.openai.serving_common import (check_grammar, new_id, now_s, prepare, run_to_end, stream,
                                                        usage)
from tokenmill.entrypoints.openai.state import ServerState, get_state
from tokenmill.frontend.input_processor import PreparedRequest, Prompt

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                        503: {"model": ErrorResponse}})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    lora = state.check_model(body.model)
    check_completion_request(body, state.settings)
    logprobs = body.logprobs
    prompt_logprobs = logprobs if body.echo and logprobs is not None else None
    params = sampling_params(body, body.max_tokens, logprobs, prompt_logprobs)
    await check_grammar(state, params)
    prompts = [prepare(state, prompt, params, "prompt", lora=lora) for prompt in _prompts(state, body)]
    request_id, created = new_id("cmpl"), now_s()
    gen = Generation(state.engine, request_id, prompts, body.n, state.metrics)
    head = {"id": request_id, "object": "text_completion", "created": created, "model": state.response_model(lora)}

    if not body.stream:
        def render() -> dict:
            return {**head, "choices": [_final_choice(state, gen, c.index, body) for c in gen.choices],
                    "usage": usage(gen)}
        return await run_to_end(request, state, gen, render)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echoed: set[int] = set()

    def render_step(deltas: list[ChoiceDelta]) -> list[dict]:
        choices = []
        for d in deltas:
            text = d.text
            if body.echo and d.choice.index not in echoed:
                echoed.add(d.choice.index)
                text = _prompt_text(state, prompts[d.choice.prompt]) + text
            lp = completion_logprobs(d.logprobs, logprobs) if logprobs is not None else None
            choices.append({"index": d.choice.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                            "stop_reason": d.choice.stop_reason if d.finish_reason else None})
        return [{**head, "choices": choices, **({"usage": None} if include_usage else {})}]

    def render_usage() -> dict:
        return {**head, "choices": [], "usage": usage(gen)}

    return stream(state, gen, render_step, render_usage if include_usage else None)


def _prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """The request's prompts: texts, or lists of token ids."""
    p = body.prompt
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    if len(items) > state.settings.max_prompts:
        raise APIError(400, f"prompt may hold at most {state.settings.max_prompts} prompts, got {len(items)}",
                       param="prompt")
    return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in items]


def _prompt_text(state: ServerState, prompt: PreparedRequest) -> str:
    return prompt.prompt if prompt.prompt is not None else state.tokenizer.decode(prompt.prompt_token_ids)


def _final_choice(state: ServerState, gen: Generation, index: int, body: CompletionRequest) -> dict:
    choice = gen.choices[index]
    prompt = gen.prompts[choice.prompt]
    text = choice.text
    lp = None
    if body.logprobs is not None:
        lp = completion_logprobs(choice.logprobs, body.logprobs)
    if body.echo:
        prefix = _prompt_text(state, prompt)
        text = prefix + text
        if lp is not None:
            lp = _with_prompt_logprobs(state, gen, choice.prompt, body.logprobs, lp)
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason}


def _with_prompt_logprobs(state: ServerState, gen: Generation, prompt_index: int, k: int, generated: dict) -> dict:
    rows = gen.prompt_logprobs[prompt_index] or [None]
    prompt = gen.prompts[prompt_index]
    head = completion_logprobs(rows, k)
    if prompt.prompt_token_ids:  # the first prompt token has no logprob, but it has a text
        first = state.tokenizer.decode(prompt.prompt_token_ids[:1])
        head["tokens"][0] = first
        head["text_offset"] = [0] + [o + len(first) for o in head["text_offset"][1:]]
    shift = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
    return {"tokens": head["tokens"] + generated["tokens"],
            "token_logprobs": head["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + generated["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in generated["text_offset"]]}
