"""A model split over ranks (TP=2, PP=2, TP=2 x PP=2: the mp executor, gloo) generates the same
greedy tokens as one process, for several model families, with async scheduling on and off.

Each case is one engine; the families spread over the layouts so that every family runs split
by tensor parallelism and every layout meets both scheduling modes.
"""

from __future__ import annotations

import pytest

from tests.helpers.invariance import greedy_params
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tokenmill import LLM

CASES = [  # (family, tensor_parallel_size, pipeline_parallel_size, async_scheduling)
    ("llama", 2, 1, True),
    ("qwen2-mqa-tied", 2, 1, False),
    ("qwen3", 1, 2, True),
    ("qwen2-mqa-tied", 1, 2, False),
    ("qwen3", 2, 2, False),
    ("llama", 2, 2, True),
]


@pytest.mark.parametrize("family,tp,pp,async_scheduling", CASES,
                         ids=[f"{f}-tp{tp}-pp{pp}-{'async' if a else 'sync'}" for f, tp, pp, a in CASES])
def test_split_model_matches_one_process(family_dirs, one_process_reference, family, tp, pp,
                                         async_scheduling) -> None:
    reference = one_process_reference(family)
    with LLM(family_dirs[family], tensor_parallel_size=tp, pipeline_parallel_size=pp,
             async_scheduling=async_scheduling, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, f"{family} tp={tp} pp={pp} async={async_scheduling}")
        # A second batch on the same engine: requests join a running pipeline, out of step.
        again = llm.generate(PROMPTS[::-1], greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference[::-1], again, "second batch")
        assert_idle(llm)
