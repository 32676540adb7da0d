"""Bounds every request is checked against before any work, and its SamplingParams.

Checks here are the server's own (flags in `ServerSettings`) and the context window;
the engine's `SamplingParams.validate` checks the values of each field afterwards.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

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


def check_completion_request(req: CompletionRequest, s: ServerSettings, max_logprobs: int) -> None:
    check_sampling_request(req, s)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    if req.logprobs is not None and req.logprobs > max_logprobs:
        raise APIError(400, f"logprobs must be <= {max_logprobs}, got {req.logprobs}", param="logprobs")


def check_chat_request(req: ChatCompletionRequest, s: ServerSettings, max_logprobs: int) -> None:
    check_sampling_request(req, s)
    if req.chat_template is not None:
        raise APIError(400, "chat_template: request-supplied chat templates are not allowed",
                       param="chat_template")
    if len(req.messages) > s.max_messages:
        raise APIError(400, f"messages may hold at most {s.max_messages} messages, got {len(req.messages)}",
                       param="messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs > max_logprobs:
            raise APIError(400, f"top_logprobs must be <= {max_logprobs}, got {req.top_logprobs}",
                           param="top_logprobs")
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, "response_format: only type 'text' is supported", param="response_format")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")


def completion_budget(prompt_len: int, requested: int | None, max_model_len: int, prompt_name: str) -> int:
    """max_tokens for a prompt of `prompt_len` tokens: `requested`, or all the context left when None."""
    asked = requested if requested is not None else max(max_model_len - prompt_len, 1)
    if prompt_len >= max_model_len or prompt_len + asked > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the {prompt_name}, {asked} in the completion). "
            f"Please reduce the length of the {prompt_name} or completion.",
            param=prompt_name if prompt_len >= max_model_len or requested is None else "max_tokens",
            code="context_length_exceeded")
    return asked


def sampling_params(req: _SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
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
    )
