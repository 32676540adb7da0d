"""Speculative decoding with structured outputs: constrained rows draft (n-gram and a draft model),
every draft position is sampled under the grammar state after the drafts before it, and the
outputs are the plain engine's token for token (greedy; seeded too with n-gram drafts, whose
noise is per position). The runs really accept drafts, reject drafts, and meet drafts the
grammar forbids (the counters say so). A tiny random model (byte tokens) for every mode, and the
real SmolLM2 (multi-byte tokens, a JSON schema) once."""

from __future__ import annotations

import json
import re

import pytest

from tests.engine.conftest import tiny_llm
from tests.helpers.requirements import require_smollm2
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

# Prompts that repeat themselves (n-gram lookup finds drafts) in ways the grammars partly forbid.
TINY_PROMPTS = ["abcabcabcabcabcab", "xyz-xyz-xyz-xyz-x", "hello hello hello hel", "aaaaabbbbbaaaaabbbbb",
                "q1q2q3q1q2q3q1q2"]
TINY_REGEXES = [r"[a-c]{30}", r"(xyz-|xy-){8}", r"[a-z ]{30}", r"(a|b){5}(c|b){20}", r"(q[0-9]){12}"]
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 5}}


def tiny_params(sampling: str) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r), **SAMPLINGS[sampling])
            for r in TINY_REGEXES]


def assert_same_and_drafted(got, want, llm, regexes) -> None:
    for out, regex in zip(got, regexes):
        assert re.fullmatch(regex, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", out.outputs[0]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats, grammars = llm.scheduler_stats(), llm.engine.grammars
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats  # accepted and rejected
    assert grammars.num_drafts_forbidden > 0, "no draft met the grammar's refusal"


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("proposer, sampling", [("ngram", "greedy"), ("ngram", "seeded"), ("draft", "greedy")])
def test_constrained_drafts_change_nothing(tiny_model_dir, tiny_reference, proposer, sampling, async_scheduling):
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0} if proposer == "ngram" else
            {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3, "max_step_tokens": 0})
    want = tiny_reference.generate(TINY_PROMPTS, tiny_params(sampling), use_tqdm=False)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling, speculative_config=spec)
    got = llm.generate(TINY_PROMPTS, tiny_params(sampling), use_tqdm=False)
    assert_same_and_drafted(got, want, llm, TINY_REGEXES)
    llm.shutdown()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "langs": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "minItems": 1, "maxItems": 4},
    "year": {"type": "integer", "minimum": 1990, "maximum": 2030}}, "required": ["name", "langs", "year"]}
EXAMPLES = ('{"name": "Ann", "langs": ["python", "rust"], "year": 2001}\n'
            '{"name": "Bob", "langs": ["go", "rust"], "year": 1999}\n')
WORDS = r"(one|two|three|four)( (one|two|three|four)){8}"


def test_constrained_drafts_on_smollm2(smollm2_llm) -> None:
    require_smollm2()
    prompts = ["Programmers as JSON lines:\n" + EXAMPLES, "one two three four one two three four one two"]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=WORDS))]
    want = smollm2_llm.generate(prompts, params, use_tqdm=False)
    with LLM("smollm2", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.25, single_process=True,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0}) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        jsonschema.validate(json.loads(got[0].outputs[0].text), SCHEMA)
        assert_same_and_drafted(got, want, llm, [r"\{.*\}", WORDS])
