"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, with vLLM's names.

By default the engine core and its workers run in their own processes (`MPClient`);
`single_process=True` keeps them in this one (`InprocClient`, same classes, no sockets).
Use as a context manager, or call `shutdown()`; garbage collection and interpreter exit
clean up too.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from tokenmill.config import EngineArgs
from tokenmill.frontend.core_client import EngineCoreClient, InprocClient, make_client
from tokenmill.frontend.input_processor import Prompt
from tokenmill.frontend.setup import build_frontend
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import TelemetryReport
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        parts = build_frontend(model, kwargs)
        self.engine_args, self.config, self.tokenizer = parts.engine_args, parts.config, parts.tokenizer
        self.input_processor, self.output_processor = parts.input_processor, parts.output_processor
        self.client: EngineCoreClient = make_client(self.config, self.engine_args.single_process)
        self._request_ids = itertools.count()

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

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        # Validate everything before any work, so a bad prompt costs nothing and loses nothing.
        inputs = []
        for prompt, params in zip(prompts, params_list):
            text, ids = self.input_processor.tokenize(prompt)
            self.input_processor.validate(ids, params)
            inputs.append((text, ids, msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)))
        return self._run(inputs, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, inputs, use_tqdm: bool) -> list[RequestOutput]:
        order: list[str] = []
        for text, ids, params in inputs:
            request_id = str(next(self._request_ids))
            requests = self.input_processor.make_requests(ids, params)
            self.output_processor.add_request(request_id, [r.handle for r in requests], text, ids, params)
            for request in requests:
                self.client.add_request(request)
            order.append(request_id)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        record = self.client.telemetry.record
        try:
            while self.output_processor.has_unfinished():
                waiting = time.perf_counter()
                step = self.client.get_outputs()
                got = time.perf_counter()
                generated += step.num_new_tokens()
                processed = self.output_processor.process_outputs(step)
                record("get_outputs", waiting, got)
                record("process_outputs", got, time.perf_counter())
                if processed.handles_to_abort:
                    self.client.abort_requests(processed.handles_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            self._abort_all(order, results)
            raise
        finally:
            bar.close()
        self.client.drain()  # in-process: a step scheduled past the last finish (async) completes now
        return [results[r] for r in order]

    def _abort_all(self, order: list[str], done: dict[str, RequestOutput]) -> None:
        for request_id in order:
            if request_id not in done:
                self.client.abort_requests(self.output_processor.abort_request(request_id))
        self.client.drain()  # in-process: finish steps already submitted

    def kv_cache_stats(self) -> dict[str, int]:
        """Free and total KV blocks, and requests still in the engine (for leak checks)."""
        return msgspec.structs.asdict(self.client.kv_cache_stats())

    def scheduler_stats(self) -> dict[str, int | float]:
        """Running and waiting requests, KV usage, prefix-cache hits, preemptions."""
        return msgspec.structs.asdict(self.client.scheduler_stats())

    def telemetry(self) -> TelemetryReport:
        """Every process's message counters and step timings since the last reset: the
        front-end, the engine core, then each worker (see `tokenmill.metrics`)."""
        return self.client.telemetry_report()

    def reset_telemetry(self) -> None:
        self.client.reset_telemetry()

    def shutdown(self) -> None:
        """Stop the engine (idempotent); later calls raise EngineDeadError in multi-process mode."""
        client = self.__dict__.get("client")  # absent when __init__ failed
        if client is not None:
            client.shutdown()

    def __del__(self) -> None:
        self.shutdown()
