"""Structured outputs through `LLM.generate` on SmolLM2 (in-process engine, async scheduling on):
constrained and plain requests share steps; every constrained answer follows its grammar and ends
with `stop`; plain requests are untouched by their neighbours' masks; logprobs see the masked
logits; a grammar that completes ends its request even with ignore_eos; bad constraints fail in
`prepare`, naming the field; speculative decoding stays on for the plain rows."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers.requirements import require_smollm2
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "langs": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "minItems": 1, "maxItems": 2},
    "year": {"type": "integer", "minimum": 1990, "maximum": 2030}}, "required": ["name", "langs", "year"]}
PROMPTS = ["Describe a programmer as JSON:", "Write a product code:", "Is the sky blue? Answer:",
           "A list in parentheses:", "The capital of France is"]


def constrained_params(**extra) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA), **extra),
            SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-\d{4}"), **extra),
            SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), **extra),
            SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
                grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z] | [0-9]'), **extra)]


def check_constrained(outs) -> None:
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [(t, o.outputs[0].finish_reason)
                                                                      for t, o in zip(texts, outs)]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", texts[1])
    assert texts[2] in ("yes", "no")
    assert re.fullmatch(r"\((?:[a-z0-9])(?:,[a-z0-9])*\)", texts[3]), texts[3]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 3}])
def test_constrained_and_plain_requests_share_steps(smollm2_llm, sampling) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = smollm2_llm.generate(PROMPTS[4:], plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = smollm2_llm.generate(PROMPTS, constrained_params(**sampling) + [plain], use_tqdm=False)
    check_constrained(outs[:4])
    assert outs[4].outputs[0].token_ids == alone  # the neighbours' masks change nothing here


def test_logprobs_see_the_masked_logits(smollm2_llm) -> None:
    """One digit: the ten digit tokens hold all the probability, and nothing else has any."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=12,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]"))
    out = smollm2_llm.generate(["My favourite number is"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]", out.text)
    top = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in top.items() if math.isfinite(lp.logprob)}
    assert len(finite) == 10 and abs(sum(math.exp(v) for v in finite.values()) - 1.0) < 1e-4


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(smollm2_llm) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = smollm2_llm.generate(["Pick a Greek letter:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


@pytest.mark.parametrize("so, words", [
    (StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}'),
     "structured_outputs.json: invalid JSON schema"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json: invalid JSON schema"),
    (StructuredOutputsParams(regex="[z-a]"), "structured_outputs.regex: invalid regular expression"),
    (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar: invalid grammar"),
    (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
    (StructuredOutputsParams(), "exactly one of"),
])
def test_bad_constraints_fail_in_prepare(smollm2_llm, so, words) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        smollm2_llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)


def test_speculative_decoding_stays_on_for_plain_rows(tmp_path) -> None:
    require_smollm2()
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = ["one two three four one two three four one two three"]
    with LLM("smollm2", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.25, single_process=True,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        outs = llm.generate(PROMPTS[:4] + prompt, constrained_params(temperature=0.0) + [plain], use_tqdm=False)
        check_constrained(outs[:4])
        stats = llm.scheduler_stats()
    with LLM("smollm2", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.25, single_process=True) as ref:
        expected = ref.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[4].outputs[0].token_ids == expected
    assert stats["spec_num_draft_tokens"] > 0  # the plain row was drafted


def test_preempted_constrained_requests_resume_their_grammar() -> None:
    """A KV pool too small for the batch: constrained requests are preempted with tokens in flight
    and recomputed; their matchers carry on where they were and every answer still validates."""
    require_smollm2()
    # Digits and letters alternate: a matcher one token behind allows the wrong class.
    alternating = StructuredOutputsParams(regex=r"([0-9][a-z]){25}")
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=alternating)] * 3
    prompts = [f"Programmer number {i} as JSON:" for i in range(6)]
    with LLM("smollm2", dtype="float32", max_model_len=256, num_gpu_blocks_override=20, block_size=16,
             single_process=True) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler_stats()["num_preemptions"] > 0
    for i, out in enumerate(outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        if i % 2 == 0:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        else:
            assert re.fullmatch(r"([0-9][a-z]){25}", out.outputs[0].text)
