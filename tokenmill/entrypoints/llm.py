"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, with vLLM's names.

By default the engine core and its workers run in their own processes (`MPClient`);
`single_process=True` keeps them in this one (`InprocClient`, same classes, no sockets).
Requests go through the `EngineFrontend` like `AsyncLLM`'s; `LLM` only waits, blocking, for
the outputs of all of them. Use as a context manager, or call `shutdown()`; garbage
collection and interpreter exit clean up too.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.frontend.core_client import EngineCoreClient
from tokenmill.frontend.engine_frontend import EngineFrontend
from tokenmill.frontend.inproc_client import InprocClient
from tokenmill.frontend.input_processor import PreparedRequest, Prompt
from tokenmill.frontend.mp_client import MPClient
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import TelemetryReport
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        self._start(EngineFrontend.from_kwargs(model, kwargs))

    @classmethod
    def from_frontend(cls, frontend: EngineFrontend) -> LLM:
        """An LLM on a front-end built beforehand (to prepare requests before the engine loads)."""
        llm = cls.__new__(cls)
        llm._start(frontend)
        return llm

    def _start(self, frontend: EngineFrontend) -> None:
        self.frontend = frontend
        self.client: EngineCoreClient = frontend.start(InprocClient, MPClient)
        self._request_ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.frontend.config

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    @property
    def output_processor(self) -> OutputProcessor:
        return self.frontend.output_processor

    @property
    def engine(self):
        """The in-process EngineCore (single_process=True only); otherwise use
        `kv_cache_stats()` / `scheduler_stats()`."""
        if isinstance(self.client, InprocClient):
            return self.client.engine
        raise AttributeError("LLM.engine exists only with single_process=True; the engine core runs in "
                             "its own process: use kv_cache_stats() or scheduler_stats()")

    def get_tokenizer(self):
        return self.tokenizer

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | PreparedRequest | Sequence[Prompt | PreparedRequest],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """A `PreparedRequest` (from `frontend.prepare`) carries its own params: give no
        `sampling_params` with it. `lora_request`: one adapter for every prompt, or one (or None:
        the base model) per prompt."""
        if isinstance(prompts, (str, Mapping, PreparedRequest)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        # Check everything before any work, so a bad prompt costs nothing and loses nothing.
        requests = [self.frontend.request(prompt, params).with_lora(self.frontend.lora_ref(lora))
                    .with_output_kind(RequestOutputKind.FINAL_ONLY)
                    for prompt, params, lora in zip(prompts, params_list, loras)]
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.frontend.chat_prompt(c, add_generation_prompt, chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, requests: list[PreparedRequest], use_tqdm: bool) -> list[RequestOutput]:
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            for request in requests:
                request_id = str(next(self._request_ids))
                self.frontend.submit(request_id, request)
                order.append(request_id)
            while self.frontend.has_unfinished():
                waiting = time.perf_counter()
                step = self.client.get_outputs()
                self.client.telemetry.record("get_outputs", waiting, time.perf_counter())
                generated += step.num_new_tokens()
                processed = self.frontend.process(step)
                for failure in processed.failures.values():
                    raise failure
                for out in processed.request_outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in order:
                self.frontend.abort(request_id)
            self.client.drain()  # in-process: finish steps already submitted
            raise
        finally:
            bar.close()
        self.client.drain()  # in-process: a step scheduled past the last finish (async) completes now
        return [results[r] for r in order]

    def kv_cache_stats(self) -> dict[str, int]:
        """Free and total KV blocks, and requests still in the engine (for leak checks)."""
        return msgspec.structs.asdict(self.client.kv_cache_stats())

    def scheduler_stats(self) -> dict[str, int | float]:
        """Running and waiting requests, KV usage, prefix-cache hits, preemptions."""
        return msgspec.structs.asdict(self.client.scheduler_stats())

    def telemetry(self) -> TelemetryReport:
        """Every process's message counters and step timings since the last reset: the
        front-end, the engine core, then each worker (see `tokenmill.metrics`); with
        speculation, its counters over the same window in `speculation` (derived figures:
        `tokenmill.metrics.spec_decode.spec_figures`)."""
        return self.client.telemetry_report()

    def reset_telemetry(self) -> None:
        self.client.reset_telemetry()

    def shutdown(self) -> None:
        """Stop the engine (idempotent); later calls raise EngineDeadError in multi-process mode."""
        frontend = self.__dict__.get("frontend")  # absent when __init__ failed
        if frontend is not None:
            frontend.shutdown()

    def __del__(self) -> None:
        self.shutdown()
