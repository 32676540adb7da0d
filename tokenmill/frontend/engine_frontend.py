"""The one way a request enters or leaves the engine, shared by `LLM` and `AsyncLLM`.

An `EngineFrontend` owns the resolved config, the tokenizer, the input and output
processors and, once started, the core client. A request goes:

    prepare(prompt, params) -> PreparedRequest   tokenize and check everything, before any work
    submit(request_id, prepared)                 one engine request per sample, registered, sent
    process(outputs) -> ProcessedOutputs         detokenize, stop strings; handles a stop string
                                                 (or a failure) ended are aborted in the core
    abort(request_id)                            forgotten here, aborted in the core

Building one resolves the engine arguments and loads the tokenizer, so bad arguments fail
before any process starts, and requests can be prepared (checked) before the engine loads;
`start` then launches the engine. `LLM` and `AsyncLLM` differ only in how they wait for the
core's outputs (their client's `get_outputs`).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.frontend.core_client import CoreClient
from tokenmill.frontend.engine_config import resolve_engine_config
from tokenmill.frontend.input_processor import (ContextOverflow, InputProcessor, OverflowReporter, PreparedRequest,
                                                Prompt)
from tokenmill.frontend.output_processor import OutputProcessor, ProcessedOutputs
from tokenmill.lora.peft import read_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.protocol import EngineCoreOutputs, LoRARef
from tokenmill.sampling_params import SamplingParams

ClientT = TypeVar("ClientT", bound=CoreClient)


class EngineFrontend:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        config = resolve_engine_config(engine_args)
        # Where the grammar backend's vocabulary goes for the engine core (written on first use).
        vocab_file = os.path.join(tempfile.gettempdir(), f"tokenmill-vocab-{os.getpid()}-{uuid.uuid4().hex[:8]}.json")
        self.config: EngineConfig = msgspec.structs.replace(
            config, structured=msgspec.structs.replace(config.structured, vocab_file=vocab_file))
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or self.config.model.path)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._client: CoreClient | None = None
        self._checked_loras: set[tuple[int, str]] = set()  # (id, path) of adapters found servable

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict[str, Any]) -> EngineFrontend:
        """`LLM(model, **kwargs)`'s arguments: each must be an `EngineArgs` field."""
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(EngineArgs(model=model, **kwargs))

    def start(self, inproc: Callable[[EngineConfig], ClientT], mp: Callable[[EngineConfig], ClientT]) -> ClientT:
        """Start the engine with the client the arguments ask for (in this process, or its own)."""
        if self._client is not None:
            raise RuntimeError("the engine is already started")
        client = (inproc if self.engine_args.single_process else mp)(self.config)
        self._client = client
        return client

    @property
    def client(self) -> CoreClient:
        if self._client is None:
            raise RuntimeError("the engine is not started")
        return self._client

    # ------------------------------------------------------------------ requests

    def prepare(self, prompt: Prompt, params: SamplingParams,
                overflow_error: OverflowReporter = ContextOverflow.error) -> PreparedRequest:
        """Tokenize and check the request (every check, once); raises one ValueError naming the
        field, or what `overflow_error` makes of a prompt that does not fit the context."""
        return self.input_processor.prepare(prompt, params, overflow_error)

    def request(self, prompt: Prompt | PreparedRequest, params: SamplingParams | None) -> PreparedRequest:
        """`prompt` prepared with `params` (default: SamplingParams()); a PreparedRequest as it is
        (it carries its own params: giving others too is an error)."""
        if isinstance(prompt, PreparedRequest):
            if params is not None:
                raise ValueError("sampling_params: a prepared request carries its own")
            return prompt
        return self.prepare(prompt, params if params is not None else SamplingParams())

    def lora_ref(self, lora: LoRARequest | None) -> LoRARef | None:
        """A request's adapter, checked once per (id, path) against the base model: raises
        `LoRAAdapterError` (a ValueError; `LoRANotFoundError` for a missing folder) naming it."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        limits = self.config.lora
        if limits is None:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} given, but LoRA is not enabled "
                             f"(enable_lora=True, or --enable-lora)")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked_loras:
            read_adapter(lora.lora_path, self.config.model.arch, limits.max_lora_rank, lora.lora_name)
            self._checked_loras.add(key)
        return lora.ref()

    def forget_lora(self, lora: LoRARequest) -> None:
        """Check the adapter's folder again next time (it was unloaded; it may change)."""
        self._checked_loras.discard((lora.lora_int_id, lora.lora_path))

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> dict:
        """`conversation` rendered with the model's chat template (and `tools`, OpenAI's function
        definitions, for templates that show them), as a prompt for `prepare`."""
        text = self.tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids}

    async def check_grammar(self, params: SamplingParams) -> None:
        """A structured output's grammar compiled (ValueError naming the problem), without blocking
        the event loop; `prepare`'s own check is then a cache hit."""
        await self.input_processor.grammars.check_async(params)

    def submit(self, request_id: str, request: PreparedRequest) -> None:
        """Register the request and send it to the core (n engine requests for n samples).
        Raises ValueError if `request_id` is already running, EngineDeadError once the core is gone."""
        client = self.client  # an engine not started refuses before anything is registered
        engine_requests = self.input_processor.make_requests(request)
        self.output_processor.add_request(request_id, [r.handle for r in engine_requests], request.prompt,
                                          request.prompt_token_ids, request.params)
        try:
            for engine_request in engine_requests:
                client.add_request(engine_request)
        except BaseException:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Forget the request and stop what is left of it in the core (unknown ids: nothing)."""
        handles = self.output_processor.abort_request(request_id)
        if handles:
            self.client.abort_requests(handles)

    def process(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """The core's outputs of one step as `RequestOutput`s (and failures, by request id)."""
        start = time.perf_counter()
        processed = self.output_processor.process_outputs(outputs)
        if processed.handles_to_abort:
            self.client.abort_requests(processed.handles_to_abort)
        self.client.telemetry.record("process_outputs", start, time.perf_counter())
        return processed

    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished()

    def shutdown(self) -> None:
        """Stop the engine, if it was started (idempotent)."""
        if self._client is not None:
            self._client.shutdown()
        self.input_processor.grammars.close()
