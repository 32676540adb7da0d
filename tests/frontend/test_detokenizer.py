from __future__ import annotations

import logging
import random

import pytest
from tokenizers import Tokenizer

from tokenmill.frontend.detokenizer import IncrementalDetokenizer, backend_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Café naïve résumé — “quotes” and ‘more’ …",
    "日本語のテキストと中文字符，한국어도 있어요。",
    "Emoji: 🎉🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 end",
    "Mixed: ñ 世界 🎉 Ω≈ç√∫ ™ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n\ttabs  and   spaces",
    "  leading spaces and trailing  ",
]


def run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte: every multi-byte character is split over tokens."""
    return [tok.token_to_id(_BYTE_CHARS[b]) for b in text.encode()]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table used by ByteLevel.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_CHARS = _bytes_to_unicode()


def test_backend_tokenizer(smol_hf, smol):
    assert backend_tokenizer(smol_hf) is smol
    assert backend_tokenizer(smol) is smol
    with pytest.raises(TypeError):
        backend_tokenizer(object())


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split_bytes", [False, True])
def test_roundtrip_never_emits_partial_characters(smol, text, split_bytes):
    ids = byte_ids(smol, text) if split_bytes else smol.encode(text, add_special_tokens=False).ids
    chunks = run(IncrementalDetokenizer(smol, smol.encode("Say:").ids), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text == smol.decode(ids, skip_special_tokens=True)
    if split_bytes and len(text.encode()) > len(text):
        assert "" in chunks[:-1]  # some tokens completed no character


def test_matches_hf_decode_on_random_sequences(smol, smol_hf):
    rng = random.Random(1234)
    vocab = smol.get_vocab_size()
    byte_tokens = [i for i in map(smol.token_to_id, _BYTE_CHARS.values()) if i is not None]
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        out = [rng.choice(byte_tokens) if rng.random() < 0.4 else
               rng.randrange(17) if rng.random() < 0.1 else rng.randrange(vocab)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            text = "".join(run(IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip), out))
            assert text == smol_hf.decode(out, skip_special_tokens=skip)


def test_in_context_equals_decode_of_output_for_byte_level(smol):
    prompt = smol.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n").ids
    out = smol.encode(" Hello 世界!", add_special_tokens=False).ids
    in_context = smol.decode(prompt + out)[len(smol.decode(prompt)):]
    text = "".join(run(IncrementalDetokenizer(smol, prompt), out))
    assert text == in_context == smol.decode(out) == " Hello 世界!"


def test_prompt_ending_mid_character(smol):
    ids = byte_ids(smol, "abc 世界")
    prompt, out = ids[:-2], ids[-2:]  # the last character is split between prompt and output
    chunks = run(IncrementalDetokenizer(smol, prompt), out)
    assert "".join(chunks) == smol.decode(out) == "\ufffd\ufffd"  # two stray continuation bytes
    assert chunks[:-1] == ["", ""]  # held while more bytes could come, shown at the end


def test_flush_shows_unfinished_character(smol):
    ids = byte_ids(smol, "ok 🎉")[:-1]
    chunks = run(IncrementalDetokenizer(smol, []), ids)
    assert chunks[-1] == "\ufffd"
    assert "".join(chunks) == smol.decode(ids)


def test_special_tokens(smol):
    out = smol.encode("Hi", add_special_tokens=False).ids + [2, 0] + smol.encode(" there", add_special_tokens=False).ids
    for skip, expected in ((True, "Hi there"), (False, "Hi<|im_end|><|endoftext|> there")):
        for spaces in (True, False):
            detok = IncrementalDetokenizer(smol, [1], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            assert "".join(run(detok, out)) == expected


def test_id_past_the_tokenizer_has_no_text_and_is_logged_once(smol, caplog):
    """The model's vocabulary may be padded past the tokenizer's: such an id is possible."""
    out = smol.encode("Hello world", add_special_tokens=False).ids
    past = smol.get_vocab_size(with_added_tokens=True)
    detok = IncrementalDetokenizer(smol, [])
    with caplog.at_level(logging.WARNING, logger="tokenmill.frontend.detokenizer"):
        text = detok.push(out[0]) + detok.push(past) + detok.push(10**7) + "".join(detok.push(i) for i in out[1:])
    assert text == "Hello world"
    warnings = [r for r in caplog.records if "past the tokenizer" in r.getMessage()]
    assert len(warnings) == 1 and str(past) in warnings[0].getMessage()


class FailingStream:
    """A DecodeStream whose `at`-th step raises `error` (as tokenizers raises: a plain Exception)."""

    def __init__(self, stream, error: Exception, at: int) -> None:
        self.stream, self.error, self.at, self.calls = stream, error, at, 0

    def step(self, tokenizer, token_id: int):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.stream.step(tokenizer, token_id)


def test_invalid_prefix_restarts_the_stream_without_losing_text(smol, caplog):
    text = "Café 🎉 ok"
    ids = byte_ids(smol, text)
    at = len("Café ".encode()) + 2  # inside the emoji: two of its bytes are pending
    detok = IncrementalDetokenizer(smol, [])
    detok._stream = FailingStream(detok._stream, Exception("Invalid prefix encountered while decoding"), at)
    with caplog.at_level(logging.WARNING, logger="tokenmill.frontend.detokenizer"):
        chunks = run(detok, ids)
    assert "".join(chunks) == text and all("\ufffd" not in c for c in chunks)
    assert any("Invalid prefix" in r.getMessage() for r in caplog.records)


def test_any_other_decoder_error_propagates(smol):
    ids = smol.encode("Hello world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(smol, [])
    detok._stream = FailingStream(detok._stream, Exception("decoder exploded"), 2)
    detok.push(ids[0])
    with pytest.raises(Exception, match="decoder exploded"):
        detok.push(ids[1])


def test_sentencepiece_leading_space_uses_prompt_context(spm):
    ids = {p: spm.token_to_id(p) for p in ["▁hello", "▁world", "▁", "<0xE4>", "<0xB8>", "<0x96>", "!"]}
    prompt = [ids["▁hello"]]
    out = [ids[p] for p in ["▁world", "▁", "<0xE4>", "<0xB8>", "<0x96>", "!"]]
    chunks = run(IncrementalDetokenizer(spm, prompt), out)
    assert chunks == [" world", " ", "", "", "世", "!", ""]
    assert "".join(chunks) == spm.decode(prompt + out)[len(spm.decode(prompt)):]
    assert spm.decode(out) == "world 世!"  # alone, the decoder strips the leading space
