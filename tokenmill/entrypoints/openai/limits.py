"""The server's own bounds on a request, and the request as SamplingParams.

Checks here are only what the HTTP API adds: the flags in `ServerSettings` (how many of
each thing a request may hold) and the fields OpenAI's API combines. The values of each
field, token ids and the context window are the engine's to check (`EngineFrontend.prepare`),
once; `context_length_error` only words the engine's finding as OpenAI does.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from tokenmill.frontend.input_processor import ContextOverflow
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# Fields an engine ValueError may name; they become the error's `param`.
KNOWN_FIELDS = frozenset(SamplingParams.__struct_fields__) | {
    "prompt", "prompt_token_ids", "messages", "max_completion_tokens", "top_logprobs", "tokens"}


def check_sampling_request(req: _SamplingRequest, s: ServerSettings) -> None:
    if req.n > s.max_n:
        raise APIError(400, f"n must be <= {s.max_n}, got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > s.max_stop:
        raise APIError(400, f"stop may hold at most {s.max_stop} strings, got {len(stops)}", param="stop")
    if any(len(x) > s.max_stop_chars for x in stops):
        raise APIError(400, f"stop strings may be at most {s.max_stop_chars} characters long", param="stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > s.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids may hold at most {s.max_stop_token_ids} ids, "
                            f"got {len(req.stop_token_ids)}", param="stop_token_ids")
    if req.logit_bias is not None and len(req.logit_bias) > s.max_logit_bias:
        raise APIError(400, f"logit_bias may hold at most {s.max_logit_bias} entries, got {len(req.logit_bias)}",
                       param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.structured_outputs is not None and req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, "response_format and structured_outputs cannot both constrain the output",
                       param="response_format")


def check_completion_request(req: CompletionRequest, s: ServerSettings) -> None:
    check_sampling_request(req, s)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")


def check_message_count(count: int, s: ServerSettings) -> None:
    if count > s.max_messages:
        raise APIError(400, f"messages may hold at most {s.max_messages} messages, got {count}", param="messages")


def check_chat_request(req: ChatCompletionRequest, s: ServerSettings) -> None:
    check_sampling_request(req, s)
    if req.chat_template is not None:
        raise APIError(400, "chat_template: request-supplied chat templates are not allowed",
                       param="chat_template")
    check_message_count(len(req.messages), s)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")


def context_length_error(overflow: ContextOverflow, prompt_name: str) -> APIError:
    """The engine's context-window finding in OpenAI's words; `prompt_name`: the request field
    holding the prompt ("prompt" or "messages")."""
    n, limit = overflow.prompt_len, overflow.max_model_len
    # No max_tokens means all the context the prompt leaves (at least one token).
    asked = overflow.max_tokens if overflow.max_tokens is not None else max(limit - n, 1)
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{n + asked} tokens ({n} in the {prompt_name}, {asked} in the completion). "
        f"Please reduce the length of the {prompt_name} or completion.",
        param=prompt_name if overflow.prompt_too_long or overflow.max_tokens is None else "max_tokens",
        code="context_length_exceeded")


def sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """`max_tokens` None: all the context the prompt leaves."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=req.logit_bias or None,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop or None,
        stop_token_ids=req.stop_token_ids or None,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_params(req),
    )


def structured_params(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint: vLLM's `structured_outputs`, or OpenAI's `response_format`."""
    body = req.structured_outputs
    if body is not None:
        return StructuredOutputsParams(json=body.json_, regex=body.regex, choice=body.choice, grammar=body.grammar,
                                       json_object=body.json_object,
                                       disable_any_whitespace=body.disable_any_whitespace)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required for type json_schema",
                       param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)
