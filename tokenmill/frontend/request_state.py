"""Front-end state of one request and of each of its n samples (one engine handle each).

A sample accumulates token ids, text and logprobs from `EngineCoreOutput`s, ends on the
engine's finish reason or on a stop string matched here, and renders itself as a
`CompletionOutput` either cumulatively or as the delta since its last rendering.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.logprobs import logprob_dicts
from tokenmill.frontend.stop_checker import StopChecker
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tokenmill.protocol import EngineCoreOutput, FinishReason, Logprobs
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class SampleState:
    def __init__(self, index: int, handle: int, params: SamplingParams,
                 prompt_token_ids: Sequence[int], tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.handle = handle
        self._params = params
        self._tokenizer = tokenizer if params.detokenize else None
        self._detok: IncrementalDetokenizer | None = None
        if self._tokenizer is not None:
            self._detok = IncrementalDetokenizer(
                self._tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._stops: StopChecker | None = None
        if params.stop and self._detok is not None:
            self._stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""
        want_logprobs = params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # What DELTA renderings have already handed out.
        self._sent_chars = 0
        self._sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Applies one engine output; True when a stop string ended the sample here
        (tokens after the one that completed it are dropped)."""
        rows = None
        if out.logprobs is not None and self.logprobs is not None:
            rows = logprob_dicts(out.logprobs, self._tokenizer)
        last = len(out.new_token_ids) - 1
        for k, token in enumerate(out.new_token_ids):
            self.token_ids.append(token)
            if rows is not None and k < len(rows):
                self._add_logprobs(rows[k])
            if self._detok is None:
                continue
            if k == last and out.finish_reason == FinishReason.STOP and not self._params.include_stop_str_in_output:
                continue  # the EOS / stop token's text is not part of the output
            new = self._detok.push(token)
            if not new:
                continue
            self.text += new
            if self._stops is not None and len(self.token_ids) > self._params.min_tokens:
                match = self._stops.find(self.text, len(new))
                if match is not None:
                    self.text = self.text[:match.keep]
                    self.finish_reason, self.stop_reason = str(FinishReason.STOP), match.stop
                    return True
        if out.finish_reason is not None:
            if self._detok is not None:
                self.text += self._detok.flush()
            self.finish_reason = str(out.finish_reason)
            self.stop_reason = out.stop_token_id if out.finish_reason == FinishReason.STOP else None
        return False

    def _add_logprobs(self, row: dict[int, Logprob]) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        self.logprobs.append(row)
        self.cumulative_logprob += next(iter(row.values())).logprob  # the chosen token comes first

    def completion(self, delta: bool) -> CompletionOutput:
        text = self.text
        if self._stops is not None and not self.finished:
            text = text[:self._stops.safe_length(text)]  # may still become part of a stop string
        ids, logprobs = self.token_ids, self.logprobs
        if delta:
            text = text[self._sent_chars:]
            self._sent_chars += len(text)
            ids = ids[self._sent_tokens:]
            logprobs = logprobs[self._sent_tokens:] if logprobs is not None else None
            self._sent_tokens = len(self.token_ids)
        else:
            ids = list(ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(self.index, text, ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)


class RequestState:
    def __init__(self, request_id: str, handles: Sequence[int], prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._tokenizer = tokenizer if params.detokenize else None
        self.samples = [SampleState(i, h, params, prompt_token_ids, tokenizer) for i, h in enumerate(handles)]
        # Position 0 has no logprob (nothing precedes it), as in vLLM.
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self._prompt_logprobs_handle: int | None = None
        self._sent_prompt_logprobs = 0
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {"arrival_time": arrival_time}

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def add_prompt_logprobs(self, handle: int, packed: Logprobs) -> None:
        # Every sample sees the same prompt: keep the rows of the first handle that sends any.
        if self.prompt_logprobs is None or self._prompt_logprobs_handle not in (None, handle):
            return
        self._prompt_logprobs_handle = handle
        self.prompt_logprobs.extend(logprob_dicts(packed, self._tokenizer))

    def record_tokens(self, now: float) -> None:
        self.metrics.setdefault("first_token_time", now)
        self.metrics["last_token_time"] = now

    def make_output(self, changed: Sequence[SampleState]) -> RequestOutput | None:
        """The RequestOutput for this step; None for FINAL_ONLY until every sample finished.

        CUMULATIVE and FINAL_ONLY list all n samples in index order; DELTA lists only
        the samples in `changed`, in index order, each with its `index`.
        """
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        samples = sorted(changed, key=lambda s: s.index) if delta else self.samples
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:
            if delta:
                prompt_logprobs = prompt_logprobs[self._sent_prompt_logprobs:] or None
                self._sent_prompt_logprobs = len(self.prompt_logprobs)
            else:
                prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.completion(delta) for s in samples], finished, prompt_logprobs,
                             self.num_cached_tokens, dict(self.metrics))
