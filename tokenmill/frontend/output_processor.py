"""Turns the engine core's token-id outputs into `RequestOutput`s, in the front-end process.

Each user request runs as n engine requests (handles), one per sample; their outputs are
gathered into one RequestOutput per request per `process_outputs` call. Stop strings are
matched here: the handles they end are returned so the caller aborts them in the core,
and any output that still arrives for a finished handle is ignored.

Requests come checked (`InputProcessor.prepare`); nothing here checks them again. An
unexpected exception while turning one request's output into text (a bug) fails that
request alone: it is logged with its traceback, the request is forgotten, its handles are
returned for aborting, and the exception is handed to its caller (a 500 in the server). A
request the engine failed alone (an output with a `failure`: non-finite logits, a sampling
error) ends the same way, with a `RequestFailedError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import RequestFailedError
from tokenmill.frontend.detokenizer import backend_tokenizer
from tokenmill.frontend.request_state import RequestState, SampleState
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    handles_to_abort: list[int] = field(default_factory=list)  # ended here (stop string or failure)
    failures: dict[str, Exception] = field(default_factory=dict)  # request id -> what broke it


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        """`tokenizer`: a Hugging Face fast tokenizer or a `tokenizers.Tokenizer`; None only
        when every request has detokenize=False."""
        self._tokenizer = backend_tokenizer(tokenizer) if tokenizer is not None else None
        self._requests: dict[str, RequestState] = {}
        # Invariant: holds exactly the unfinished samples of the requests in `_requests`.
        self._by_handle: dict[int, tuple[RequestState, SampleState]] = {}

    def add_request(self, request_id: str, handles: list[int], prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        """Registers a checked request; the ValueErrors are the caller's mistakes, not the user's."""
        if params.detokenize and self._tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer; this engine has none")
        if len(handles) != params.n:
            raise ValueError(f"expected n={params.n} handles, got {len(handles)}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(set(handles)) != len(handles) or any(h in self._by_handle for h in handles):
            raise ValueError(f"handles {handles} are not all new")
        state = RequestState(request_id, handles, prompt, prompt_token_ids, params, self._tokenizer,
                             time.time() if arrival_time is None else arrival_time)
        self._requests[request_id] = state
        for sample in state.samples:
            self._by_handle[sample.handle] = (state, sample)

    def process_outputs(self, outputs: EngineCoreOutputs | Sequence[EngineCoreOutput],
                        timestamp: float | None = None) -> ProcessedOutputs:
        """One step's outputs; `timestamp` (the time they were produced) defaults to now."""
        now = time.time() if timestamp is None else timestamp
        result = ProcessedOutputs()
        changed: dict[str, list[SampleState]] = {}
        if isinstance(outputs, EngineCoreOutputs):
            self._process_one_tokens(outputs, now, changed, result)
            outputs = outputs.outputs
        for out in outputs:
            entry = self._by_handle.get(out.handle)
            if entry is None:
                continue  # finished or aborted already; the core may not know yet
            state, sample = entry
            if out.failure is not None:  # this request alone failed in the engine: it ends here
                self._fail(state, RequestFailedError(out.failure.message), changed, result)
                continue
            try:
                stopped = self._apply(state, sample, out, now)
            except Exception as exc:  # noqa: BLE001 - a bug: fail this request (logged), not the engine
                self._fail(state, exc, changed, result)
                continue
            if stopped is None:
                continue  # a prefill chunk: nothing to show yet
            self._note(state, sample, stopped, changed, result)
        for request_id, samples in changed.items():
            state = self._requests[request_id]
            request_output = state.make_output(samples)
            if request_output is not None:
                result.request_outputs.append(request_output)
            if state.finished:
                del self._requests[request_id]
        return result

    def _process_one_tokens(self, outputs: EngineCoreOutputs, now: float,
                            changed: dict[str, list[SampleState]], result: ProcessedOutputs) -> None:
        """The packed part of a step: requests whose only news is one new token."""
        handles, tokens = outputs.one_token_rows()
        for handle, token in zip(handles.tolist(), tokens.tolist()):
            entry = self._by_handle.get(handle)
            if entry is None:
                continue  # finished or aborted already; the core may not know yet
            state, sample = entry
            try:
                state.record_tokens(now)
                stopped = sample.update(EngineCoreOutput(handle, [token]))
            except Exception as exc:  # noqa: BLE001 - as above
                self._fail(state, exc, changed, result)
                continue
            if not sample.finished and state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to render until the request finishes
            self._note(state, sample, stopped, changed, result)

    def _note(self, state: RequestState, sample: SampleState, stopped: bool,
              changed: dict[str, list[SampleState]], result: ProcessedOutputs) -> None:
        """Marks `sample` for rendering; a sample a stop string ended is handed back for aborting."""
        if stopped:
            result.handles_to_abort.append(sample.handle)
        samples = changed.setdefault(state.request_id, [])
        if sample not in samples:
            samples.append(sample)
        if sample.finished:
            del self._by_handle[sample.handle]

    def _fail(self, state: RequestState, exc: Exception, changed: dict[str, list[SampleState]],
              result: ProcessedOutputs) -> None:
        if isinstance(exc, RequestFailedError):
            logger.warning("request %s failed in the engine: %s", state.request_id, exc)
        else:
            logger.error("request %s failed while processing its output", state.request_id, exc_info=exc)
        result.failures[state.request_id] = exc
        result.handles_to_abort += self.abort_request(state.request_id)
        changed.pop(state.request_id, None)

    @staticmethod
    def _apply(state: RequestState, sample: SampleState, out: EngineCoreOutput, now: float) -> bool | None:
        """One engine output into its sample: True when a stop string ended it here, None when
        there is nothing to show yet (a prefill chunk)."""
        if out.prompt_logprobs is not None:
            state.add_prompt_logprobs(out.handle, out.prompt_logprobs)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if not out.new_token_ids and out.finish_reason is None:
            return None
        if out.new_token_ids:
            state.record_tokens(now)
        return sample.update(out)

    def abort_request(self, request_id: str) -> list[int]:
        """Forgets the request; returns the handles of its samples still running in the core."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        live = [s.handle for s in state.samples if not s.finished]
        for handle in live:
            del self._by_handle[handle]
        return live

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def num_unfinished(self) -> int:
        return len(self._requests)
