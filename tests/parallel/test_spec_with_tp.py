"""Speculative decoding on a tensor-parallel model: n-gram drafts verified by TP=2 ranks give
the one-process plain engine's greedy tokens; modes not built (speculation with PP, a draft
model with TP) are refused at resolution, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.invariance import assert_same_greedy, greedy_params
from tests.parallel.conftest import ENGINE, NEW_TOKENS, assert_idle
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.frontend.engine_config import resolve_engine_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0}


def repetitive_prompts(count: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"prompt_token_ids": (phrase := rng.integers(5, 200, int(rng.integers(4, 10))).tolist()) * 3}
            for _ in range(count)]


def test_ngram_with_tp2_equals_one_process(family_dirs) -> None:
    path, prompts = family_dirs["llama"], repetitive_prompts(4)
    with LLM(path, single_process=True, async_scheduling=False, **ENGINE) as llm:
        reference = llm.generate(prompts, greedy_params(NEW_TOKENS), use_tqdm=False)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)  # logprobs turn drafts off
    with LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **ENGINE) as llm:
        outputs = llm.generate(prompts, plain, use_tqdm=False)
        stats = llm.scheduler_stats()
        assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
        assert_idle(llm)
    # a divergence only where the one-process run had a near tie (float32 sums in another order)
    assert_same_greedy(reference, outputs, "ngram tp=2", NEW_TOKENS)


@pytest.mark.parametrize("kwargs,field", [
    (dict(pipeline_parallel_size=2, speculative_config=NGRAM), "speculative_config"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "SAME",
                                                      "num_speculative_tokens": 2}), "speculative_config.model"),
])
def test_unbuilt_combinations_are_refused(tiny_model, kwargs, field) -> None:
    spec = kwargs["speculative_config"]
    if spec.get("model") == "SAME":
        kwargs["speculative_config"] = {**spec, "model": tiny_model}
    with pytest.raises(ValueError, match=field):
        resolve_engine_config(EngineArgs(model=tiny_model, **kwargs))
