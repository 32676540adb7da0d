"""TP=2 greedy without logprobs: every step's argmax taken across the ranks' vocab columns
(`worker/sharded_greedy.py` for eager steps, which are all of them on CPU; the decode graphs'
greedy tail does the same on CUDA) gives one process's tokens."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tokenmill import LLM, SamplingParams


@pytest.mark.parametrize("family", ["llama"])
def test_tp2_plain_greedy_matches_one_process(family_dirs, one_process_reference, family) -> None:
    """(Planted: rank 1's ids not offset by its first vocab row: fails.)"""
    reference = one_process_reference(family)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)  # no logprobs: plain greedy
    with LLM(family_dirs[family], tensor_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_matches_one_process(reference, outputs, f"{family} tp=2, argmax across vocab shards")
        assert_idle(llm)
