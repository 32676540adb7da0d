"""XGrammar behind a small interface: a compiler per vocabulary, matchers, batched bitmask fills.

Why XGrammar: its compiled grammars split the vocabulary into tokens decided by the grammar
state alone (precomputed masks) and the few that need the parser's stack, so filling a mask
costs tens of microseconds per row even for a JSON string that accepts almost every token; its
`BatchGrammarMatcher` fills many rows on a thread pool without the GIL; it rolls back (each
draft position of a constrained row is masked from a matcher advanced through the drafts before
it, then rolled back: core/grammar_masks.py) and it bounds JSON whitespace (`max_whitespace_cnt`). See
docs/structured-outputs.md for what was measured.

The bitmask is XGrammar's own: int32 [rows, ceil(V / 32)], bit t % 32 of word t // 32 set when
token t is allowed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from tokenmill.config import StructuredOutputConfig
from tokenmill.structured_output.grammar_spec import GrammarSpec, choice_ebnf


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_threads() -> int:
    """Threads that fill a step's masks: all but four of this process's cores (the engine core's
    loop, the worker, the front-end), at least half of them, at most 16. Inside a JSON string a
    row's mask costs ~0.1-0.3 ms with a 128k vocabulary, so 256 rows need several threads to stay
    under a decode step."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cores // 2, min(16, cores - 4))


class GrammarBackend:
    """One vocabulary's compiler (with its cache) and matchers."""

    def __init__(self, tokenizer_info: Any, config: StructuredOutputConfig, compile_threads: int = 2) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.config = config
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        # A matcher (terminate_without_stop_token off) ends only by accepting one of these.
        self.stop_token_ids = frozenset(int(t) for t in tokenizer_info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=compile_threads, cache_enabled=True,
                                            cache_limit_bytes=512 << 20)
        self._batch: Any = None

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                       config: StructuredOutputConfig) -> GrammarBackend:
        """From a Hugging Face tokenizer (the front-end); `vocab_size` is the model's logits width."""
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        return cls(info, config)

    @classmethod
    def from_json(cls, text: str, config: StructuredOutputConfig) -> GrammarBackend:
        """From `serialize()`'s text (the engine core, which loads no tokenizer)."""
        import xgrammar as xgr
        return cls(xgr.TokenizerInfo.deserialize_json(text), config)

    def serialize(self) -> str:
        return self.tokenizer_info.serialize_json()

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; ValueError naming the field for a grammar the library refuses."""
        field = "json" if spec.kind == "json_object" else spec.kind
        try:
            c = self.compiler
            if spec.kind in ("json", "json_object"):
                json.loads(spec.text)  # a clear message for text that is not JSON at all
                whitespace = self.config.max_whitespace if spec.any_whitespace else None
                return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace, strict_mode=True,
                                             max_whitespace_cnt=whitespace)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "choice":
                return c.compile_grammar(choice_ebnf(json.loads(spec.text)))
            return c.compile_grammar(spec.text)
        except Exception as exc:  # noqa: BLE001 - the library's own words, as the request's error
            message = _LOCATION.sub("", " ".join(str(exc).split()))[:500] or type(exc).__name__
            raise ValueError(f"structured_outputs.{field}: invalid {_NOUN[spec.kind]}: {message}") from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], out: np.ndarray) -> None:
        """Each matcher's next-token mask into rows 0..len(matchers) of `out` (int32 [rows, words]),
        on XGrammar's thread pool."""
        self.fill_bitmask_at(matchers, out, None)

    def fill_bitmask_at(self, matchers: list[Any], out: np.ndarray, indices: list[int] | None) -> None:
        """Each matcher's next-token mask into row indices[i] of `out` (None: rows 0..n)."""
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher(fill_threads())
        self._batch.batch_fill_next_token_bitmask(matchers, out, indices)

    def accept_tokens(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token; False (and no change) where the grammar forbids it.
        Ids outside the vocabulary are refused here (the library would log them as errors)."""
        ok = [0 <= t < self.vocab_size for t in tokens]
        picked = [i for i, good in enumerate(ok) if good]
        if picked:
            accepted = self._xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in picked],
                                                                         [tokens[i] for i in picked])
            for i, good in zip(picked, accepted):
                ok[i] = bool(good)
        return ok

    def rollback(self, matchers: list[Any], counts: list[int]) -> None:
        """Undo the last counts[i] tokens of matcher i."""
        if matchers:
            self._xgr.BatchGrammarMatcher.batch_rollback(matchers, counts)


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # the library's "[time] file.cc:line: " prefix
_NOUN = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
