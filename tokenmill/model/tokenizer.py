"""Loads a fast tokenizer from a HF directory or a GGUF file (converted once, then cached)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.model import gguf_cache
from tokenmill.model.paths import check_model_path, is_gguf_file


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A fast tokenizer; `.backend_tokenizer` is the `tokenizers.Tokenizer` used for detokenization."""
    check_model_path(path)
    if is_gguf_file(path):
        entry = gguf_cache.get_or_create(path, "tokenizer", lambda d: _convert_gguf(path).save_pretrained(d))
        tokenizer = _convert_gguf(path) if entry is None else AutoTokenizer.from_pretrained(entry)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.is_fast:
        raise ValueError(f"model {path!r}: only fast tokenizers are supported, got {type(tokenizer).__name__}")
    return tokenizer


def _convert_gguf(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    except KeyError as exc:  # transformers reads tokenizer.ggml.* fields without checking
        raise ValueError(f"model {path!r}: the GGUF file has no usable tokenizer "
                         f"(missing tokenizer.ggml metadata field {exc.args[0]!r})") from None
