"""Constrained greedy steps end in the masked greedy step-end graph (greedy_tail.py's masked twin):
the grammar masks land in its static block and one replay applies them, takes the argmax and
updates the device state. On CPU, through the real `ModelRunner.capture_graphs` with eager
replays (tests/helpers/graphs.py): the outputs are the eager engine's token for token (which
applies the same masks to the logits before `Sampler.sample`), match their regexes, and the
masked twins really ran; unconstrained rows in the same batch are left unmasked. With n-gram
speculation the verification graph's masked twin masks each draft position."""

from __future__ import annotations

import re

import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_structured_speculation import TINY_PROMPTS, TINY_REGEXES
from tests.helpers.graphs import capture_real_graphs, replays
from tokenmill import SamplingParams, StructuredOutputsParams

GRAPHED = dict(max_num_seqs=8, max_num_batched_tokens=128)


def params(unconstrained: int = 0) -> list[SamplingParams]:
    constrained = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r))
                   for r in TINY_REGEXES]
    return constrained + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * unconstrained


def masked_replays(runner) -> int:
    tails = (runner.graph_tail, runner.recording_tail, runner.verify_tail)
    return sum(replays(t.masked_twin) for t in tails if t is not None)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize("spec", [False, True])
def test_masked_greedy_tail_equals_eager(tiny_model_dir, reference, spec, monkeypatch) -> None:
    prompts = TINY_PROMPTS + ["plain row", "another plain row"]
    want = reference.generate(prompts, params(2), use_tqdm=False)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0} if spec else None
    llm = tiny_llm(tiny_model_dir, async_scheduling=True, speculative_config=speculative, **GRAPHED)
    runner = capture_real_graphs(llm, monkeypatch)
    got = llm.generate(prompts, params(2), use_tqdm=False)
    for out, regex in zip(got, TINY_REGEXES):
        assert re.fullmatch(regex, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", out.outputs[0]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert masked_replays(runner) > (3 if spec else 10), masked_replays(runner)
    if spec:
        assert replays(runner.verify_tail.masked_twin) > 3, replays(runner.verify_tail.masked_twin)
        assert llm.engine.grammars.num_drafts_forbidden > 0
    llm.shutdown()
