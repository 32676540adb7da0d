from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, Logprobs
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
EOS = 2  # <|im_end|>
PROMPT = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompt_ids(smol) -> list[int]:
    return smol.encode(PROMPT).ids


def encode(smol, text: str) -> list[int]:
    return smol.encode(text, add_special_tokens=False).ids


def start(smol, prompt_ids, request_id="r", handles=(7,), **params) -> OutputProcessor:
    processor = OutputProcessor(smol)
    processor.add_request(request_id, list(handles), PROMPT, prompt_ids, SamplingParams(n=len(handles), **params))
    return processor


def step(processor: OutputProcessor, handle: int, ids: list[int], finish: FinishReason | None = None, **kw):
    return processor.process_outputs([EngineCoreOutput(handle, ids, finish, **kw)])


def stream(processor: OutputProcessor, handle: int, ids: list[int], finish: FinishReason | None = None):
    """One token per step; returns every RequestOutput and every handle to abort."""
    outs, aborts = [], []
    for k, token in enumerate(ids):
        result = step(processor, handle, [token], finish if k == len(ids) - 1 else None)
        outs += result.request_outputs
        aborts += result.handles_to_abort
    return outs, aborts


def test_plain_generation_cumulative(smol, prompt_ids):
    processor = start(smol, prompt_ids)
    ids = encode(smol, "One, two, three 🎉.") + [EOS]
    outs, aborts = stream(processor, 7, ids, FinishReason.STOP)
    assert aborts == [] and not processor.has_unfinished() and processor.num_unfinished() == 0
    final = outs[-1]
    assert isinstance(final, RequestOutput) and final.finished and final.request_id == "r"
    assert final.prompt == PROMPT and final.prompt_token_ids == prompt_ids
    (completion,) = final.outputs
    assert completion.text == "One, two, three 🎉." and completion.token_ids == ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert all(completion.text.startswith(o.outputs[0].text) for o in outs)  # cumulative prefixes
    assert all("\ufffd" not in o.outputs[0].text for o in outs)
    assert all(not o.finished for o in outs[:-1])
    assert set(final.metrics) == {"arrival_time", "first_token_time", "last_token_time"}
    assert final.metrics["arrival_time"] <= final.metrics["first_token_time"] <= final.metrics["last_token_time"]


def test_stop_token_id_and_length(smol, prompt_ids):
    ids = encode(smol, "a b c")
    processor = start(smol, prompt_ids, stop_token_ids=[ids[-1]], skip_special_tokens=False)
    out = step(processor, 7, ids, FinishReason.STOP, stop_token_id=ids[-1]).request_outputs[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("a b", ids, "stop", ids[-1])
    processor = start(smol, prompt_ids, skip_special_tokens=False, include_stop_str_in_output=True)
    out = step(processor, 7, ids + [EOS], FinishReason.STOP).request_outputs[0].outputs[0]
    assert out.text == "a b c<|im_end|>"  # the EOS text only with include_stop_str_in_output
    processor = start(smol, prompt_ids)
    out = step(processor, 7, ids, FinishReason.LENGTH).request_outputs[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a b c", "length", None)


def test_stop_string_spanning_tokens(smol, prompt_ids):
    ids = encode(smol, "Hello world, goodbye moon")
    processor = start(smol, prompt_ids, stop=["ld, goo"])
    outs, aborts = stream(processor, 7, ids)
    assert aborts == [7] and not processor.has_unfinished()
    out = outs[-1].outputs[0]
    assert outs[-1].finished and (out.text, out.finish_reason, out.stop_reason) == ("Hello wor", "stop", "ld, goo")
    upto = next(k for k in range(len(ids)) if "ld, goo" in smol.decode(ids[:k + 1]))
    assert out.token_ids == ids[:upto + 1] and upto + 1 < len(ids)
    # The core may send more before it sees the abort: ignored.
    assert step(processor, 7, ids[upto + 1:]).request_outputs == []


def test_stop_string_at_start_and_included(smol, prompt_ids):
    ids = encode(smol, "STOP here please")
    out = stream(start(smol, prompt_ids, stop=["STOP"]), 7, ids)[0][-1].outputs[0]
    assert (out.text, out.stop_reason) == ("", "STOP")
    processor = start(smol, prompt_ids, stop=["here"], include_stop_str_in_output=True)
    out = stream(processor, 7, ids)[0][-1].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("STOP here", "stop", "here")


def test_several_stop_strings_earliest_wins(smol, prompt_ids):
    ids = encode(smol, "alpha beta gamma delta")
    processor = start(smol, prompt_ids, stop=["gamma", "ta g", "alpha x"])
    out = step(processor, 7, ids).request_outputs[0].outputs[0]  # all in one step (spec decode)
    assert (out.text, out.stop_reason) == ("alpha be", "ta g")
    assert smol.decode(out.token_ids).endswith("gamma") and len(out.token_ids) < len(ids)


def test_delta_holds_back_partial_stop_and_never_passes_it(smol, prompt_ids):
    text = "The answer is <end of> yes <end>, then more text"
    ids = encode(smol, text)
    processor = start(smol, prompt_ids, stop=["<end>"], output_kind=DELTA)
    outs, aborts = stream(processor, 7, ids)
    deltas = [o.outputs[0].text for o in outs]
    assert "".join(deltas) == "The answer is <end of> yes "
    shown = ""
    for delta in deltas:
        shown += delta
        assert not shown.endswith("<") and "<end>" not in shown
    sent_ids = [t for o in outs for t in o.outputs[0].token_ids]
    upto = next(k for k in range(len(ids)) if "<end>" in smol.decode(ids[:k + 1]))
    assert sent_ids == ids[:upto + 1]
    assert aborts == [7] and outs[-1].finished and outs[-1].outputs[0].stop_reason == "<end>"


def test_held_back_text_is_released_at_the_end(smol, prompt_ids):
    ids = encode(smol, "wait for <en")
    processor = start(smol, prompt_ids, stop=["<end>"], output_kind=DELTA)
    outs, _ = stream(processor, 7, ids, FinishReason.LENGTH)
    assert "".join(o.outputs[0].text for o in outs) == "wait for <en"
    assert [o.outputs[0].text for o in outs][-1].endswith("<en")
    cumulative = start(smol, prompt_ids, stop=["<end>"])
    outs, _ = stream(cumulative, 7, ids[:-1])
    assert not outs[-1].outputs[0].text.endswith("<")


def test_min_tokens_defers_stop_strings(smol, prompt_ids):
    ids = encode(smol, "stop now and stop later")
    processor = start(smol, prompt_ids, stop=["stop"], min_tokens=2)
    out = stream(processor, 7, ids)[0][-1].outputs[0]
    assert out.text == "stop now and " and out.stop_reason == "stop"


def test_n3_aggregation_and_output_kinds(smol, prompt_ids):
    texts = ["first answer", "second one here", "third"]
    ids = [encode(smol, t) for t in texts]
    handles = (10, 11, 12)
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        processor = start(smol, prompt_ids, handles=handles, output_kind=kind)
        collected: list[RequestOutput] = []
        for k in range(max(map(len, ids))):
            batch = [EngineCoreOutput(h, [seq[k]], FinishReason.LENGTH if k == len(seq) - 1 else None)
                     for h, seq in zip(handles, ids) if k < len(seq)]
            collected += processor.process_outputs(batch).request_outputs
        assert not processor.has_unfinished()
        assert all(o.request_id == "r" for o in collected)
        assert [o.finished for o in collected] == [False] * (len(collected) - 1) + [True]
        if kind == FINAL_ONLY:
            assert len(collected) == 1
        if kind == DELTA:
            for i, t in enumerate(texts):
                parts = [c for o in collected for c in o.outputs if c.index == i]
                assert "".join(c.text for c in parts) == t
                assert sum((c.token_ids for c in parts), []) == ids[i]
            assert [c.index for c in collected[-1].outputs] == [1]  # only what changed
        else:
            final = collected[-1]
            assert [c.index for c in final.outputs] == [0, 1, 2]
            assert [c.text for c in final.outputs] == texts
            assert all(c.finish_reason == "length" for c in final.outputs)
            assert [c.text for c in collected[0].outputs] == ([smol.decode(s[:1]) for s in ids]
                                                              if kind == CUMULATIVE else texts)


def test_n3_one_sample_stopped_by_string(smol, prompt_ids):
    processor = start(smol, prompt_ids, handles=(1, 2, 3), stop=["X"])
    result = processor.process_outputs([EngineCoreOutput(1, encode(smol, "aXb")),
                                        EngineCoreOutput(2, encode(smol, "ab")),
                                        EngineCoreOutput(3, encode(smol, "cd"), FinishReason.LENGTH)])
    assert result.handles_to_abort == [1]
    (out,) = result.request_outputs
    assert not out.finished and [c.finish_reason for c in out.outputs] == ["stop", None, "length"]
    assert processor.abort_request("r") == [2]
    assert processor.abort_request("r") == [] and not processor.has_unfinished()


def test_abort(smol, prompt_ids):
    processor = start(smol, prompt_ids, handles=(4, 5), output_kind=DELTA)
    step(processor, 4, encode(smol, "hi"))
    assert processor.num_unfinished() == 1 and processor.abort_request("r") == [4, 5]
    assert step(processor, 4, encode(smol, " there")).request_outputs == []
    assert not processor.has_unfinished()
    # An abort reported by the core finishes the sample like any other reason.
    processor = start(smol, prompt_ids)
    out = step(processor, 7, [], FinishReason.ABORT).request_outputs[0]
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].text == ""


def _packed(rows: list[list[tuple[int, float]]], ranks: list[int]) -> Logprobs:
    return Logprobs.from_arrays(np.array([[t for t, _ in r] for r in rows]),
                                np.array([[v for _, v in r] for r in rows]), np.array(ranks))


def test_logprobs_conversion(smol, prompt_ids):
    ids = encode(smol, "Hi there")
    a, b = ids
    processor = start(smol, prompt_ids, logprobs=2, prompt_logprobs=1)
    prompt_rows = [[(prompt_ids[i], -0.5), (5, -0.1)] for i in range(1, len(prompt_ids))]
    half = len(prompt_rows) // 2
    # Prompt logprobs arrive over two prefill chunks, the first with no token yet.
    assert step(processor, 7, [], prompt_logprobs=_packed(prompt_rows[:half], [3] * half)).request_outputs == []
    gen = _packed([[(a, -1.0), (a, -1.0), (99, -2.0)]], [1])
    out = step(processor, 7, [a], logprobs=gen, prompt_logprobs=_packed(prompt_rows[half:], [3] * (len(prompt_rows) - half)),
               num_cached_tokens=16).request_outputs[0]
    gen2 = _packed([[(b, -3.0), (42, -0.25), (43, -0.5)]], [5])
    out = step(processor, 7, [b], FinishReason.LENGTH, logprobs=gen2).request_outputs[0]
    completion = out.outputs[0]
    assert math.isclose(completion.cumulative_logprob, -4.0)
    first, second = completion.logprobs
    assert list(first) == [a, 99] and first[a].rank == 1 and first[a].decoded_token == smol.decode([a])
    assert first[99].rank == 2 and math.isclose(first[99].logprob, -2.0)
    assert list(second) == [b, 42, 43] and second[b].rank == 5 and second[42].rank == 1 and second[43].rank == 2
    assert second[42].decoded_token == smol.decode([42], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    assert all(out.prompt_logprobs[i][prompt_ids[i]].rank == 3 for i in range(1, len(prompt_ids)))
    assert out.num_cached_tokens == 16


def test_logprobs_follow_stop_truncation_and_delta(smol, prompt_ids):
    ids = encode(smol, "one two three four")
    rows = [[(t, -1.0 * (k + 1))] for k, t in enumerate(ids)]
    processor = start(smol, prompt_ids, logprobs=0, prompt_logprobs=0, stop=[" three"], output_kind=DELTA)
    prompt = _packed([[(t, -0.5)] for t in prompt_ids[1:]], [1] * (len(prompt_ids) - 1))
    first = step(processor, 7, ids[:1], logprobs=_packed(rows[:1], [1]), prompt_logprobs=prompt).request_outputs[0]
    assert len(first.prompt_logprobs) == len(prompt_ids) and len(first.outputs[0].logprobs) == 1
    rest = step(processor, 7, ids[1:], logprobs=_packed(rows[1:], [1] * (len(ids) - 1))).request_outputs[0]
    assert rest.prompt_logprobs is None  # DELTA: sent once
    completion = rest.outputs[0]
    assert completion.text == " two" and completion.stop_reason == " three"
    kept = len(first.outputs[0].token_ids) + len(completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) and kept < len(ids)
    assert math.isclose(completion.cumulative_logprob, -sum(range(1, kept + 1)))


def test_detokenize_false(smol, prompt_ids):
    processor = start(smol, prompt_ids, detokenize=False, logprobs=1)
    ids = encode(smol, "some text")
    lp = _packed([[(t, -1.0), (t, -1.0)] for t in ids], [1] * len(ids))
    out = step(processor, 7, ids, FinishReason.LENGTH, logprobs=lp).request_outputs[0].outputs[0]
    assert out.text == "" and out.token_ids == ids
    assert all(d[t].decoded_token is None for d, t in zip(out.logprobs, ids))
    no_tokenizer = OutputProcessor(None)
    no_tokenizer.add_request("r", [1], None, [1, 2], SamplingParams(detokenize=False))
    with pytest.raises(ValueError, match="detokenize"):
        no_tokenizer.add_request("s", [2], None, [1, 2], SamplingParams())


def test_add_request_validation(smol, prompt_ids):
    processor = start(smol, prompt_ids)
    with pytest.raises(ValueError, match="already"):
        processor.add_request("r", [8], None, prompt_ids, SamplingParams())
    with pytest.raises(ValueError, match="handles"):
        processor.add_request("s", [7], None, prompt_ids, SamplingParams())
    with pytest.raises(ValueError, match="n=2"):
        processor.add_request("s", [8], None, prompt_ids, SamplingParams(n=2))


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_packed_one_token_outputs_render_like_full_ones(smol, prompt_ids, kind):
    """The core sends a plain one-token step in the packed columns of EngineCoreOutputs; the
    front-end must render it exactly as the same step sent as EngineCoreOutput structs
    (n=2 samples, a stop string, a finish, a handle already gone)."""
    texts = ["one two stop three four", "five six seven"]
    ids = [encode(smol, t) for t in texts]
    handles = (20, 21)
    rendered = []
    for packed in (False, True):
        processor = start(smol, prompt_ids, handles=handles, output_kind=kind, stop=["stop"])
        collected, aborted = [], []
        for k in range(max(map(len, ids))):
            plain, full = [], []
            for h, seq in zip(handles, ids):
                if k == len(seq) - 1:
                    full.append(EngineCoreOutput(h, [seq[k]], FinishReason.LENGTH))
                elif k < len(seq):
                    plain.append((h, seq[k]))
            plain.append((99, 5))  # an unknown (finished) handle is ignored
            if packed:
                step_outputs = EngineCoreOutputs(full, token_handles=np.array([h for h, _ in plain], "<i4").tobytes(),
                                                 token_ids=np.array([t for _, t in plain], "<i4").tobytes())
            else:
                step_outputs = full + [EngineCoreOutput(h, [t]) for h, t in plain]
            result = processor.process_outputs(step_outputs, timestamp=1.0)
            collected += result.request_outputs
            aborted += result.handles_to_abort
        for out in collected:
            out.metrics.pop("arrival_time")  # the wall clock at add_request
        rendered.append((collected, aborted))
    assert rendered[0] == rendered[1]
    assert rendered[0][1] == [20]  # the stop string ended sample 0
