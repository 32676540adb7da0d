"""Turns a user's prompt and SamplingParams into an EngineCoreRequest, validating everything first."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any, Union

from tokenmill.config import EngineConfig
from tokenmill.frontend.output_processor import check_detokenize_params
from tokenmill.protocol import EngineCoreRequest, pack_ids
from tokenmill.sampling_params import SamplingParams

Prompt = Union[str, Mapping[str, Any]]  # text, or {"prompt_token_ids": [...]} / {"prompt": "..."}


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        self._handles = itertools.count()

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

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate(vocab_size=self.vocab_size, max_logprobs=self.config.max_logprobs)
        check_detokenize_params(params)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty (0 tokens)")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is out of range [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens long, but max_model_len is {self.max_model_len} "
                             f"(the prompt must leave room for at least one new token)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{n + params.max_tokens} exceeds max_model_len={self.max_model_len}")

    def make_requests(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineCoreRequest]:
        """One engine request per sample (n of them); sample i of a seeded request gets seed + i."""
        now = time.time()
        packed = pack_ids(prompt_token_ids)
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                child = _replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            requests.append(EngineCoreRequest(next(self._handles), packed, child, now))
        return requests


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec
    return msgspec.structs.replace(params, **changes)
