"""The front-end's check of a request's structured output: its form, its size, and that its grammar
compiles within the time limit (asynchronously, cached by text). Every refusal is a ValueError
naming the field (a 400 from the server) and touches nothing else.

The first grammar also writes the tokenizer's vocabulary, as the grammar library serializes it,
to `config.structured.vocab_file`, where the engine core reads it (it loads no tokenizer).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.backend import GrammarBackend
from tokenmill.structured_output.compiles import GrammarCompiles
from tokenmill.structured_output.grammar_spec import GrammarSpec, canonical, grammar_spec


class GrammarCheck:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.on_compiled: Callable[[float], None] | None = None  # metrics (set by the server)
        self._compiles: GrammarCompiles | None = None

    @property
    def compiles(self) -> GrammarCompiles:
        if self._compiles is None:
            s = self.config.structured
            self._compiles = GrammarCompiles(self._make_backend, s.compile_timeout_s,
                                             on_compiled=lambda seconds: self.on_compiled and self.on_compiled(seconds))
        return self._compiles

    def _make_backend(self) -> GrammarBackend:
        m = self.config.model
        backend = GrammarBackend.from_tokenizer(self.tokenizer, m.arch.vocab_size, m.eos_token_ids,
                                                self.config.structured)
        path = self.config.structured.vocab_file
        if path:
            with open(path + ".tmp", "w") as f:
                f.write(backend.serialize())
            os.replace(path + ".tmp", path)
        return backend

    def spec(self, params: SamplingParams) -> tuple[SamplingParams, GrammarSpec | None]:
        """`params` with its constraint in canonical form, and the constraint's spec (None: none)."""
        so = params.structured_outputs
        if so is None:
            return params, None
        so = canonical(so)
        spec = grammar_spec(so, self.config.structured.max_schema_bytes)
        return msgspec.structs.replace(params, structured_outputs=so), spec

    def check(self, params: SamplingParams) -> SamplingParams:
        """Blocking: `params` canonical, once its grammar compiled (ValueError otherwise)."""
        params, spec = self.spec(params)
        if spec is not None:
            self.compiles.check(spec)
        return params

    async def check_async(self, params: SamplingParams) -> None:
        """`check` without blocking the event loop (the server calls it before `prepare`, whose own
        check is then a cache hit)."""
        params, spec = self.spec(params)
        if spec is not None:
            await self.compiles.check_async(spec)

    def close(self) -> None:
        if self._compiles is not None:
            self._compiles.shutdown()
        path = self.config.structured.vocab_file
        if path and os.path.exists(path):
            os.unlink(path)
