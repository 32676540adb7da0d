"""SamplingParams: what a request asks of the sampler and the stop logic.

A msgspec Struct so it can cross process boundaries as msgpack, never pickle.
`validate()` is the one check of a request's parameters: every field against its limit,
and the fields against each other; it raises one ValueError naming the field. The
front-end's input processor calls it once per request, before any work is done.
"""

from __future__ import annotations

import math
from enum import IntEnum

import msgspec


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A constraint on the output, with vLLM's names: exactly one of `json` (a JSON schema, as a
    dict or its text), `json_object` (any JSON object), `regex`, `choice` (one of these strings)
    or `grammar` (EBNF/GBNF text). The front-end turns a dict schema into canonical text, so a
    grammar is named (and its compilation cached) by its text. `disable_any_whitespace`: JSON
    with no free whitespace at all (otherwise whitespace is bounded, see the engine's flags)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def kind(self) -> str:
        """Which constraint this is (json | json_object | regex | choice | grammar); ValueError
        unless exactly one is set."""
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar; got {', '.join(kinds) or 'none'}")
        return kinds[0]


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self, *, vocab_size: int | None = None, max_logprobs: int = 20) -> None:
        """Raise ValueError naming the first field that breaks its limit."""
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check_finite("temperature", self.temperature)
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check_finite("top_p", self.top_p)
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        _check_finite("min_p", self.min_p)
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check_finite("presence_penalty", self.presence_penalty)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check_finite("frequency_penalty", self.frequency_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed",
                   f"must be an integer in [0, 2**63), got {self.seed!r}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None:
                _check(isinstance(value, int) and 0 <= value <= max_logprobs, field,
                       f"must be an integer in [0, {max_logprobs}], got {value!r}")
        if self.stop is not None:
            _check(all(isinstance(s, str) and s for s in self.stop), "stop",
                   "must be a list of non-empty strings")
            # Stop strings are matched on the detokenized text (as in vLLM).
            if self.stop and not self.detokenize:
                raise ValueError("stop strings are only supported when detokenize is True")
        if self.stop_token_ids is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   "must be a list of non-negative integers")
            if vocab_size is not None:
                _check(all(t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                       f"token ids must be < vocab size {vocab_size}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and token >= 0, "logit_bias",
                       f"keys must be non-negative token ids, got {token!r}")
                if vocab_size is not None:
                    _check(token < vocab_size, "logit_bias",
                           f"token id {token} is out of range for vocab size {vocab_size}")
                _check(isinstance(bias, (int, float)) and math.isfinite(bias) and -100 <= bias <= 100,
                       "logit_bias", f"values must be finite and in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None:
            _check_structured(self.structured_outputs)


_GREEDY_EPS = 1e-5


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


def _check_structured(so: StructuredOutputsParams) -> None:
    """The constraint's form (its content is the grammar backend's to check)."""
    kind = so.kind()
    if kind == "choice":
        _check(bool(so.choice) and all(isinstance(c, str) and c for c in so.choice), "structured_outputs.choice",
               "must be a non-empty list of non-empty strings")
    elif kind in ("regex", "grammar"):
        _check(isinstance(getattr(so, kind), str) and bool(getattr(so, kind)), f"structured_outputs.{kind}",
               "must be a non-empty string")
    elif kind == "json":
        _check(isinstance(so.json, (str, dict)), "structured_outputs.json", "must be a JSON schema (object or text)")


def _check_finite(field: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and math.isfinite(value), field,
           f"must be a finite number, got {value!r}")
