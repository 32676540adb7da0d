"""Tokenizers for the front-end tests: the real SmolLM2 one (loaded once per session) and a
tiny hand-made SentencePiece-style BPE with byte fallback (leading-space rules)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from tests.helpers.requirements import require_smollm2


@pytest.fixture(scope="session")
def smol_hf():
    from tokenmill.model.default_model import default_model_file
    from tokenmill.model.tokenizer import load_tokenizer
    require_smollm2()
    return load_tokenizer(default_model_file())


@pytest.fixture(scope="session")
def smol(smol_hf) -> Tokenizer:
    return smol_hf.backend_tokenizer


def make_spm_tokenizer() -> Tokenizer:
    """Llama-2 style: '▁' for spaces, a prepended '▁', <0xNN> byte-fallback tokens, and a
    decoder that strips the leading space of the decoded text."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁hello", "▁world", "hello", "world", "▁a", "b", "c", "!", "é"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="session")
def spm() -> Tokenizer:
    return make_spm_tokenizer()
