"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extra fields.

Requests ignore unknown fields, as OpenAI's and vLLM's servers do, and reject NaN and
infinities in every float. Types are checked here; limits that depend on the model or
on server flags are checked in `limits.py` and by `SamplingParams.validate`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

_INT64 = 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class StructuredOutputsBody(_Request):
    """vLLM's extra body field `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    json_: Union[str, dict[str, Any], None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=_INT64)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1, le=2**31)
    min_p: float | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_tokens: int = Field(0, ge=0, le=2**31)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # null: all the context the prompt leaves
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Request):
    name: str
    arguments: str = ""


class ToolCall(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # vLLM's extra chat fields.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # always refused: templates come from the model only
    chat_template_kwargs: dict[str, Union[str, int, float, bool, None]] | None = None


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Union[str, int, float, bool, None]] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# Responses (documented in the OpenAPI schema; streaming chunks are built as plain dicts).

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo
