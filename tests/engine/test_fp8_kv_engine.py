"""An engine with an FP8 KV cache: greedy tokens do not depend on the schedule (chunked prefill,
prefix-cache hits, preemption under a tiny pool, async scheduling, n-gram speculation), since
every query sees K/V as the cache holds them; and they differ from the float cache's somewhere
(the cache really is fp8)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.engine.test_schedule_invariance import GREEDY, NEW_TOKENS, mixed_prompts
from tests.helpers.invariance import assert_same_greedy
from tests.helpers.tiny_models import make_tiny_model_dir

LENGTHS = [5, 17, 48, 64, 95, 150]
FP8 = dict(kv_cache_dtype="fp8")
VARIANTS = {
    "chunk16": dict(FP8, async_scheduling=False, max_num_batched_tokens=16),
    "preempt": dict(FP8, async_scheduling=False, num_gpu_blocks_override=16, max_num_batched_tokens=64),
    "async-chunk16": dict(FP8, async_scheduling=True, max_num_batched_tokens=16),
    "ngram": dict(FP8, async_scheduling=False, max_num_batched_tokens=64,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0}),
}


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("peaky"), seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(LENGTHS, 259)


@pytest.fixture(scope="module")
def reference(peaky_dir, prompts):
    return tiny_llm(peaky_dir, async_scheduling=False, enable_prefix_caching=False, **FP8).generate(
        prompts, GREEDY, use_tqdm=False)


def test_fp8_cache_changes_something(peaky_dir, prompts, reference):
    plain = tiny_llm(peaky_dir, async_scheduling=False, enable_prefix_caching=False).generate(
        prompts, GREEDY, use_tqdm=False)
    assert any(a.outputs[0].logprobs != b.outputs[0].logprobs for a, b in zip(plain, reference))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp8_cache_is_schedule_invariant(peaky_dir, prompts, reference, variant):
    llm = tiny_llm(peaky_dir, **VARIANTS[variant])
    assert_same_greedy(reference, llm.generate(prompts, GREEDY, use_tqdm=False), variant, NEW_TOKENS)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits now
    assert_same_greedy(reference, again, variant + " again", NEW_TOKENS)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_engine_idle(llm)
