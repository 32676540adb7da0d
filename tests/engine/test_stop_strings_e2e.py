"""Stop conditions end to end on the real model, greedy: stop strings across token boundaries,
stop_token_ids, min_tokens, detokenize=False and special tokens in the text."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
N = 24


@pytest.fixture(scope="module")
def base(smollm2_llm):
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == N
    return out


def boundaries(tokenizer, ids: list[int]) -> list[int]:
    """Character offset where each token's text ends in the decoded text of `ids`."""
    return [len(tokenizer.decode(ids[:i + 1], skip_special_tokens=True)) for i in range(len(ids))]


def spanning_stop(tokenizer, base) -> tuple[str, int, int]:
    """A stop string that starts inside one token and ends inside the next: (stop, start, token index
    that completes it). It is the first occurrence in the text."""
    text, ends = base.text, boundaries(tokenizer, base.token_ids)
    for j in range(2, len(ends) - 1):
        start, cut, nxt = ends[j - 1], ends[j], ends[j + 1]
        if cut - start >= 2 and nxt - cut >= 2:
            stop = text[cut - 2:cut + 2]
            if text.find(stop) == cut - 2 and stop.strip():
                return stop, cut - 2, j + 1
    raise AssertionError(f"no token boundary to span in {text!r}")


def test_stop_string_across_token_boundary(smollm2_llm, base):
    tokenizer = smollm2_llm.get_tokenizer()
    assert base.text == tokenizer.decode(base.token_ids, skip_special_tokens=True)
    stop, start, last = spanning_stop(tokenizer, base)
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:start], (stop, out.text)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[:last + 1]  # up to the token that completed the stop string

    incl = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == base.text[:start + len(stop)]
    assert incl.finish_reason == "stop" and incl.stop_reason == stop

    # Several stop strings: the one that starts earliest wins; one that never occurs changes nothing.
    other = base.text[start + len(stop):start + len(stop) + 3]
    multi = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                                        stop=["never-seen-xyz", other, stop]),
                                 use_tqdm=False)[0].outputs[0]
    assert multi.text == base.text[:start] and multi.stop_reason == stop


def test_stop_token_ids(smollm2_llm, base):
    tokenizer = smollm2_llm.get_tokenizer()
    idx = next(i for i in range(3, N) if base.token_ids[i] not in base.token_ids[:i])
    stop_id = base.token_ids[idx]
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                                      stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:idx + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == tokenizer.decode(base.token_ids[:idx], skip_special_tokens=True)
    # min_tokens past it: the stop id is banned until then, so the output runs on.
    late = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, min_tokens=idx + 3,
                                                       stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert late.token_ids[:idx] == base.token_ids[:idx]
    assert stop_id not in late.token_ids[:idx + 3]
    assert len(late.token_ids) > idx + 3 or late.finish_reason == "length"


@pytest.fixture(scope="module")
def chat_base(smollm2_llm):
    messages = [{"role": "user", "content": "Say hi."}]
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm2_llm.config.model.eos_token_ids, \
        "the chat answer must end with EOS for these tests"
    assert out.stop_reason is None  # EOS, not a user stop token
    return messages, out


def test_min_tokens_delays_eos(smollm2_llm, chat_base):
    messages, base_out = chat_base
    n = len(base_out.token_ids)
    eos = set(smollm2_llm.config.model.eos_token_ids)
    out = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=n + 12, min_tokens=n + 4),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:n - 1] == base_out.token_ids[:n - 1]
    assert not eos & set(out.token_ids[:n + 4]), "EOS came before min_tokens"
    assert len(out.token_ids) > n + 4


def test_detokenize_false_leaves_text_empty(smollm2_llm, base):
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, detokenize=False),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == ""
    assert out.token_ids == base.token_ids and out.finish_reason == "length"


def test_special_tokens_in_chat_text(smollm2_llm, chat_base):
    messages, base_out = chat_base
    n = len(base_out.token_ids)

    variants = [dict(skip_special_tokens=False),
                dict(skip_special_tokens=False, include_stop_str_in_output=True),
                dict(skip_special_tokens=True, include_stop_str_in_output=True),
                dict(skip_special_tokens=False, ignore_eos=True, max_tokens=n + 1),
                dict(skip_special_tokens=True, ignore_eos=True, max_tokens=n + 1)]
    # One batch: on a shared CPU, five requests together cost little more than one.
    outs = smollm2_llm.chat([messages] * len(variants),
                            [SamplingParams(**{"temperature": 0, "max_tokens": 64, **v}) for v in variants],
                            use_tqdm=False)
    plain, kept, skipped, shown, hidden = (o.outputs[0] for o in outs)
    # As in vLLM, the EOS that ends a request is not part of its text, unless stop strings are included.
    assert "<|im_end|>" not in plain.text and plain.text == base_out.text
    assert kept.text == base_out.text + "<|im_end|>" and kept.token_ids == base_out.token_ids
    assert skipped.text == base_out.text
    # An EOS generated with ignore_eos is ordinary output: shown only with skip_special_tokens=False.
    assert shown.token_ids[:n] == base_out.token_ids and "<|im_end|>" in shown.text
    assert "<|im_end|>" not in hidden.text and hidden.text.startswith(base_out.text)
