"""Structured outputs under pipeline parallelism (two stages, worker processes): constrained greedy
requests beside plain ones give one process's tokens, async scheduling on and off. The masks go
through the ring to every rank as they do without pipeline parallelism; only the last stage (the
sampler) applies them. Pipeline parallelism schedules no row past the tokens it knows, so the
engine core starts each step's mask job (grammar thread) as soon as it submits the step and ships
it before the next submit. How full the queue of steps in flight gets is not asserted: it depends
on how the five rows split into micro-batches (while grammars compile only the plain row runs;
a second pass over cached grammars kept one step in flight with the masks made on the core's
loop, two of three with the grammar thread), not on the masks alone. The count is printed.
(The Ray executor's path: tests/parallel/test_ray_executor.py.)"""

from __future__ import annotations

import json
import re

import pytest

from tests.parallel.conftest import ENGINE, assert_idle
from tests.parallel.test_pp_telemetry import _events, _in_flight_at_each_wait, _track
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = ["abcabcabcabcab", "xyz-xyz-xyz-x", "hello hello hel", "aaaaabbbbbaaaaabbbbb", "q1q2q3q1q2"]
REGEXES = [r"[a-c]{20}", r"(xyz-|xy-){6}", r"[a-z ]{20}", None, r"(q[0-9]){10}"]


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=regex is None, structured_outputs=None if regex
                           is None else StructuredOutputsParams(regex=regex)) for regex in REGEXES]


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(tiny_model, single_process=True, async_scheduling=False, **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_requests_under_pp2(tiny_model, reference, async_scheduling, tmp_path) -> None:
    trace = tmp_path / "steps.json"
    with LLM(tiny_model, pipeline_parallel_size=2, async_scheduling=async_scheduling, trace_steps=str(trace),
             **ENGINE) as llm:
        outs = llm.generate(PROMPTS, params(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        for out, regex in zip(outs, REGEXES):
            if regex is not None:
                assert re.fullmatch(regex, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
        assert_idle(llm)
    core = _track(_events(json.loads(trace.read_text())), "core")
    masked = {e["args"]["step"] for e in core if e["name"] == "mask"}
    assert len(masked) >= 10, masked
    in_flight = _in_flight_at_each_wait(core)
    print(f"steps in flight at each wait (full queue: {2 + async_scheduling}): {in_flight}")
