"""TP with each half of a large step's rows all-reduced under the other half's GEMMs
(`model/tp_overlap.py`): the halves compute what one batch computes. In one process (the halves'
split alone: its all-reduces are the identity) the teacher-forced logprobs equal the one-batch
path's; TP=2 over gloo (started all-reduces waited for later) gives one process's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.invariance import greedy_params
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tokenmill import LLM
from tokenmill.benchmarks import layout_check as lc
from tokenmill.model.tp_overlap import split_point

FORCED = {"TOKENMILL_TP_OVERLAP": "1", "TOKENMILL_TP_OVERLAP_MIN_TOKENS": "2"}


def test_split_point() -> None:
    assert split_point(8192) == 4096 and split_point(2) == 1 and split_point(3) == 2
    assert split_point(1000) == 512 and split_point(100) == 50 and split_point(65) == 33 and split_point(257) == 192


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_halves_equal_one_batch_in_one_process(family_dirs, monkeypatch, family) -> None:
    """Prompt logprobs of every position (steps of up to 48 tokens, split in two) as the one-batch path's."""
    model = family_dirs[family]
    prompts = lc.random_prompts(lc.vocab_size(model), [5, 17, 40])
    common = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=48)
    layout = lc.base_layout(single_process=True)
    base = lc.teacher_forced_logprobs(model, layout, prompts, common)
    for key, value in FORCED.items():
        monkeypatch.setenv(key, value)
    halves = lc.teacher_forced_logprobs(model, layout, prompts, common)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(base, halves))
    assert worst < 1e-4, worst


def test_tp2_halves_match_one_process(family_dirs, one_process_reference, monkeypatch) -> None:
    for key, value in FORCED.items():
        monkeypatch.setenv(key, value)
    reference = one_process_reference("llama")
    with LLM(family_dirs["llama"], tensor_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, "llama tp=2, overlapped halves")
        assert_idle(llm)
