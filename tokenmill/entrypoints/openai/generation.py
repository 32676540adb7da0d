"""One API request's run through the engine: its prompts × n choices, as deltas.

Choice `i * n + j` is sample j of prompt i (as in vLLM). Each prompt is one engine
request with its own id; `steps()` yields the choices each engine output changed.
A choice the engine ended without a finish reason (aborted while draining) finishes
as "abort". Token counts and latencies are recorded in the server's metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.streaming import merge
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.input_processor import PreparedRequest
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


@dataclass
class Choice:
    index: int
    prompt: int  # index of its prompt
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceDelta:
    choice: Choice
    text: str
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None


class Generation:
    def __init__(self, engine: AsyncLLM, request_id: str, prompts: list[PreparedRequest], n: int,
                 metrics: ServerMetrics) -> None:
        """`prompts`: prepared (checked) already; nothing is checked again."""
        self.engine = engine
        self.prompts = prompts
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.n = n
        self.metrics = metrics
        self.choices = [Choice(i * n + j, i) for i in range(len(prompts)) for j in range(n)]
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        self._start = time.monotonic()
        self._last_output: list[float | None] = [None] * len(prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    async def steps(self) -> AsyncIterator[list[ChoiceDelta]]:
        streams = [self.engine.generate(p, request_id=rid) for p, rid in zip(self.prompts, self.request_ids)]
        self.metrics.prompt_tokens(self.prompt_tokens)
        async for i, out in merge(streams):
            yield self._apply(i, out)
        ended = [ChoiceDelta(c, "", [], "abort") for c in self.choices if c.finish_reason is None]
        for delta in ended:
            self._finish(delta.choice, "abort", None)
        if ended:
            yield ended

    async def run(self) -> None:
        async for _ in self.steps():
            pass

    def _apply(self, i: int, out: RequestOutput) -> list[ChoiceDelta]:
        now = time.monotonic()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = (self.prompt_logprobs[i] or []) + list(out.prompt_logprobs)
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            last = self._last_output[i]
            if last is None:
                self.metrics.first_token(now - self._start)
            else:
                self.metrics.inter_token(now - last)
            self._last_output[i] = now
            self.metrics.generation_tokens(new_tokens)
        deltas = []
        for c in out.outputs:
            choice = self.choices[i * self.n + c.index]
            deltas.append(self._update(choice, c))
        return deltas

    def _update(self, choice: Choice, c: CompletionOutput) -> ChoiceDelta:
        choice.text += c.text
        choice.num_tokens += len(c.token_ids)
        rows = list(c.logprobs or [])
        choice.logprobs += rows
        if c.finish_reason is not None and choice.finish_reason is None:
            self._finish(choice, c.finish_reason, c.stop_reason)
        return ChoiceDelta(choice, c.text, rows, c.finish_reason)

    def _finish(self, choice: Choice, reason: str, stop_reason: int | str | None) -> None:
        choice.finish_reason = reason
        choice.stop_reason = stop_reason
        self.metrics.finished(reason, time.monotonic() - self._start)
