"""Incremental detokenization of one sample's generated token ids.

Built on `tokenizers.decoders.DecodeStream`, which only returns a chunk once the
text decoded so far no longer ends in an incomplete UTF-8 character. The stream is
primed with a short, cleanly decodable suffix of the prompt so that decoders that
depend on the previous token (leading-space rules of SentencePiece/Metaspace,
WordPiece "##") treat the first generated token as a continuation: the text is what
the output tokens decode to in the prompt's context. For byte-level BPE this equals
`tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"
# Prompt context fed to the stream: enough tokens for any decoder's look-behind.
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24
# Trailing prompt tokens that may hold an incomplete character (UTF-8 is at most 4 bytes).
_MAX_SPLIT_TOKENS = 4
# Already emitted ids kept as left context when flushing pending ids.
_FLUSH_CONTEXT = 6


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"need a fast tokenizer (tokenizers.Tokenizer backend), got {type(tokenizer).__name__}")
    return backend


def prompt_context(tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """A short suffix of the prompt that starts and ends on whole characters.

    Trailing tokens holding half a character are dropped: their bytes belong to the
    prompt, so the output text starts like `decode(output_ids)` does.
    """
    ids = list(prompt_token_ids)
    for end in range(len(ids), max(len(ids) - _MAX_SPLIT_TOKENS, 0) - 1, -1):
        for width in range(_MIN_CONTEXT, _MAX_CONTEXT + 1):
            start = max(end - width, 0)
            if _REPLACEMENT not in tokenizer.decode(ids[start:end], skip_special_tokens=skip_special_tokens):
                return ids[start:end]
            if start == 0:
                break
    return []


class IncrementalDetokenizer:
    """Turns one token id at a time into new text; never emits half a character."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special = skip_special_tokens
        context = prompt_context(self._tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # Invariant: `_pending` holds the ids pushed since the last non-empty chunk;
        # `_emitted` ends with the ids whose text is already out (left context for flush).
        self._pending: list[int] = []
        self._emitted: list[int] = context[-_FLUSH_CONTEXT:]
        # Only needed to suppress the spaces some decoders put between added tokens.
        self._added: dict[int, str] | None = None
        if not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}
        self._last_added = False

    def push(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes ('' while a character is open)."""
        try:
            chunk = self._stream.step(self._tokenizer, token_id)
        except Exception:  # an id the decoder rejects: drop it, restart the stream on what is out
            self._stream = DecodeStream(ids=self._emitted, skip_special_tokens=self._skip_special)
            return ""
        if self._added is not None:
            raw = self._added.get(token_id)
            if raw is not None and self._last_added and chunk:
                chunk = raw
            self._last_added = raw is not None
        self._pending.append(token_id)
        if not chunk:
            return ""
        self._emitted = (self._emitted + self._pending)[-_FLUSH_CONTEXT:]
        self._pending = []
        return chunk

    def flush(self) -> str:
        """At the end of generation: the text of ids still pending, as `decode` would show them
        (an unfinished character becomes U+FFFD)."""
        if not self._pending:
            return ""
        pending, self._pending = self._pending, []
        decode = self._tokenizer.decode
        left = decode(self._emitted, skip_special_tokens=self._skip_special)
        both = decode(self._emitted + pending, skip_special_tokens=self._skip_special)
        self._emitted = (self._emitted + pending)[-_FLUSH_CONTEXT:]
        if both.startswith(left):
            return both[len(left):]
        return decode(pending, skip_special_tokens=self._skip_special)
