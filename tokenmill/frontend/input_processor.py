"""A user's prompt and SamplingParams -> a checked `PreparedRequest` -> `EngineCoreRequest`s.

`prepare` is where a request is checked, once: the prompt's form (tokenize), the
parameters (`SamplingParams.validate`), then what depends on the model: token ids in the
vocabulary, and the prompt plus max_tokens inside the context window. Every failure is one
ValueError naming the field, raised before any work is done.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.frontend.grammar_check import GrammarCheck
from tokenmill.protocol import EngineCoreRequest, LoRARef, pack_ids
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Prompt = Union[str, Mapping[str, Any]]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A prompt tokenized and its request checked, by `InputProcessor.prepare` only: submitting
    one checks nothing again."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARef | None = None  # the LoRA adapter it runs with (checked by `EngineFrontend.lora_ref`)

    def with_lora(self, lora: LoRARef | None) -> PreparedRequest:
        return self if lora is None else dataclasses.replace(self, lora=lora)

    def with_output_kind(self, kind: RequestOutputKind) -> PreparedRequest:
        """The same request, delivered as `kind` says (the kind is not checked: any is valid)."""
        return dataclasses.replace(self, params=msgspec.structs.replace(self.params, output_kind=kind))


@dataclasses.dataclass(frozen=True)
class ContextOverflow:
    """A prompt that, with its max_tokens, does not fit the context window."""

    prompt_len: int
    max_tokens: int | None  # None: all the context the prompt leaves
    max_model_len: int

    @property
    def prompt_too_long(self) -> bool:
        """The prompt alone leaves no room for a new token."""
        return self.prompt_len >= self.max_model_len

    def error(self) -> ValueError:
        """The engine's own message (the HTTP server words it as OpenAI does)."""
        n, limit = self.prompt_len, self.max_model_len
        if self.prompt_too_long:
            return ValueError(f"prompt is {n} tokens long, but max_model_len is {limit} "
                              f"(the prompt must leave room for at least one new token)")
        return ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({self.max_tokens}) = "
                          f"{n + self.max_tokens} exceeds max_model_len={limit}")


# Turns an overflow into the exception `prepare` raises (the HTTP server's is OpenAI's error).
OverflowReporter = Callable[[ContextOverflow], Exception]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = GrammarCheck(config, tokenizer)
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        self._handles = itertools.count()

    def prepare(self, prompt: Prompt, params: SamplingParams,
                overflow_error: OverflowReporter = ContextOverflow.error) -> PreparedRequest:
        """Tokenize and check everything; `overflow_error` words a context-window overflow."""
        text, ids = self.tokenize(prompt)
        params.validate(vocab_size=self.vocab_size, max_logprobs=self.config.max_logprobs)
        params = self.grammars.check(params)  # a structured output's grammar compiles (cached)
        if not ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        self.check_token_ids(ids, "prompt_token_ids")
        n = len(ids)
        if n >= self.max_model_len or (params.max_tokens is not None and n + params.max_tokens > self.max_model_len):
            raise overflow_error(ContextOverflow(n, params.max_tokens, self.max_model_len))
        return PreparedRequest(text, ids, params)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids' or 'prompt', "
                         f"got {type(prompt).__name__}")

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """Every id is one the model knows; the error names `field`."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is out of range [0, {self.vocab_size})")

    def make_requests(self, request: PreparedRequest) -> list[EngineCoreRequest]:
        """One engine request per sample (n of them); sample i of a seeded request gets seed + i."""
        now = time.time()
        packed = pack_ids(request.prompt_token_ids)
        params = request.params
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                child = msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            requests.append(EngineCoreRequest(next(self._handles), packed, child, now, request.lora))
        return requests
