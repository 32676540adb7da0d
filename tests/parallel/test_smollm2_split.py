"""The real default model (SmolLM2-135M-Instruct, GGUF: 30 layers, 9 query and 3 KV heads) split
over ranks generates one process's greedy tokens: PP=2 (15 layers per stage) with async
scheduling, TP=3 (3 query heads and 1 KV head per rank) without. TP=2 cannot split 9 heads and
is refused, naming the field."""

from __future__ import annotations

import pytest

from tests.helpers.invariance import assert_same_greedy, greedy_params
from tests.parallel.conftest import assert_idle
from tokenmill import LLM

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 12
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_gb=0.1)


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    return smollm2_llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)


@pytest.mark.parametrize("tp,pp,async_scheduling", [(1, 2, True), (3, 1, False)], ids=["pp2-async", "tp3-sync"])
def test_smollm2_split_matches_one_process(reference, tp, pp, async_scheduling) -> None:
    with LLM("smollm2", tensor_parallel_size=tp, pipeline_parallel_size=pp, async_scheduling=async_scheduling,
             **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_same_greedy(reference, outputs, f"smollm2 tp={tp} pp={pp}", NEW_TOKENS)
        assert_idle(llm)


def test_smollm2_tp2_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the model's num_attention_heads"):
        LLM("smollm2", tensor_parallel_size=2, **ENGINE)
