"""Incremental detokenization of one sample's generated token ids.

Built on `tokenizers.decoders.DecodeStream`, which only returns a chunk once the
text decoded so far no longer ends in an incomplete UTF-8 character. The stream is
primed with a short, cleanly decodable suffix of the prompt so that decoders that
depend on the previous token (leading-space rules of SentencePiece/Metaspace,
WordPiece "##") treat the first generated token as a continuation: the text is what
the output tokens decode to in the prompt's context. For byte-level BPE this equals
`tokenizer.decode(output_ids)`.

Two things the decoder can meet, handled where they happen and logged:
- an id past the tokenizer's vocabulary: ids are checked against the model's vocabulary,
  which may be padded past the tokenizer's (the embedding rounded up); such an id has no text;
- the stream's "invalid prefix" error: some decoders re-decode earlier text differently once
  a token follows (seen in vLLM, issue 17448); the stream restarts on the text already out.
Anything else the decoder raises is a bug and propagates.
"""

from __future__ import annotations

import logging
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
# How tokenizers' DecodeStream.step words the one error it raises by design (a plain Exception).
_INVALID_PREFIX = "Invalid prefix encountered"

logger = logging.getLogger(__name__)


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
        self._num_tokens = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._warned_unknown = False
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
        if token_id >= self._num_tokens:
            self._warn_unknown(token_id)
            return ""
        try:
            chunk = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions; only one is expected
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            logger.warning("detokenizer: %s at token %d; restarting the stream on the text already out",
                           exc, token_id)
            chunk = self._restart(token_id)
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

    def _restart(self, token_id: int) -> str | None:
        """A new stream on the ids whose text is out, fed the ids still pending and `token_id`."""
        self._stream = DecodeStream(ids=self._emitted, skip_special_tokens=self._skip_special)
        chunks = [self._stream.step(self._tokenizer, t) for t in (*self._pending, token_id)]
        return "".join(c for c in chunks if c) or None

    def _warn_unknown(self, token_id: int) -> None:
        if not self._warned_unknown:  # once per sample: a random model may sample many
            self._warned_unknown = True
            logger.warning("detokenizer: token id %d is past the tokenizer's %d tokens (a padded vocabulary); "
                           "it has no text", token_id, self._num_tokens)

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
