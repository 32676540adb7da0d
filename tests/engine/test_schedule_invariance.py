"""Greedy outputs do not depend on how the work is scheduled: token budget (chunked prefill),
prefix caching, preemption under a tiny KV pool, async scheduling.

The full matrix runs on a tiny random model with peaky logits (fast); one combined variant
(64-token chunks, a KV pool so small that requests are preempted, prefix caching on) runs on
the real model against the shared engine. A divergence is accepted only where the reference's
top-2 logprobs are within NEAR_TIE (float summation order may flip them).
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams

NEAR_TIE = 1e-4
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def mixed_prompts(lengths: list[int], vocab_hi: int, seed: int = 0) -> list[dict]:
    """Every other prompt starts with a shared 40-token prefix, so prefix caching has work to do."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_hi) for _ in range(40)]
    prompts = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, vocab_hi) for _ in range(n)]
        if i % 2 and n > 40:
            ids[:40] = shared
        prompts.append({"prompt_token_ids": ids})
    return prompts


def assert_same_greedy(reference, outputs, label: str, new_tokens: int = NEW_TOKENS) -> None:
    assert len(reference) == len(outputs)
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = ref.outputs[0], out.outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == new_tokens, f"{label}: prompt {i}"
        for pos, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                top2 = sorted((lp.logprob for lp in ref.logprobs[pos].values()), reverse=True)[:2]
                gap = top2[0] - top2[1] if len(top2) == 2 else 0.0
                assert gap < NEAR_TIE, (f"{label}: prompt {i} differs at token {pos} (gap {gap:.2e})\n"
                                        f"ref {ref.token_ids}\ngot {out.token_ids}")
                break


# ---------------------------------------------------------------- tiny model matrix

TINY_LENGTHS = [5, 9, 16, 17, 31, 48, 64, 95, 128, 150, 190, 200]
TINY_VARIANTS = {
    "chunk16": dict(max_num_batched_tokens=16),
    "chunk64": dict(max_num_batched_tokens=64),
    "chunk24-unaligned": dict(max_num_batched_tokens=24),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunk16-no-prefix-cache": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "preempt": dict(num_gpu_blocks_override=16, max_num_batched_tokens=64),
    "preempt-no-prefix-cache": dict(num_gpu_blocks_override=16, enable_prefix_caching=False),
    "max-num-seqs-3": dict(max_num_seqs=3, max_num_batched_tokens=32),
    "async": dict(async_scheduling=True, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory) -> str:
    # Larger weights than HF's default init: logits with clear winners, so ties are rare.
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("peaky"), seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def tiny_prompts():
    return mixed_prompts(TINY_LENGTHS, 259)


@pytest.fixture(scope="module")
def tiny_reference(peaky_dir, tiny_prompts):
    llm = tiny_llm(peaky_dir)
    return llm.generate(tiny_prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_greedy_is_schedule_invariant(peaky_dir, tiny_prompts, tiny_reference, variant):
    llm = tiny_llm(peaky_dir, **TINY_VARIANTS[variant])
    outs = llm.generate(tiny_prompts, GREEDY, use_tqdm=False)
    assert_same_greedy(tiny_reference, outs, variant)
    scheduler = llm.engine.scheduler
    if "preempt" in variant:
        assert scheduler.num_preemptions > 0, "the tiny pool never preempted"
    if variant.startswith("chunk16"):
        assert scheduler.step_id >= sum(len(p["prompt_token_ids"]) for p in tiny_prompts) // 16
    if TINY_VARIANTS[variant].get("enable_prefix_caching", True):
        # Again, now that the prompts are cached: the hits must give the same tokens.
        hits = scheduler.kv.stats.hits
        assert_same_greedy(tiny_reference, llm.generate(tiny_prompts, GREEDY, use_tqdm=False), variant + " again")
        if "preempt" not in variant:
            assert scheduler.kv.stats.hits > hits
    assert_engine_idle(llm)


# ---------------------------------------------------------------- the real model

REAL_LENGTHS = [5, 47, 130, 210, 300]
REAL_NEW_TOKENS = 16


@pytest.mark.slow
def test_real_model_chunked_preempted_matches_shared_engine(smollm2_llm):
    tokenizer = smollm2_llm.get_tokenizer()
    text = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep and sings "
            "an old song about rivers, mountains, cities and the sea. ") * 40
    ids = tokenizer(text).input_ids
    rng = random.Random(5)
    prompts = []
    for i, n in enumerate(REAL_LENGTHS):
        start = 0 if i % 2 else rng.randrange(1, 200)  # odd prompts share the text's beginning
        prompts.append({"prompt_token_ids": ids[start:start + n]})
    greedy = SamplingParams(temperature=0.0, max_tokens=REAL_NEW_TOKENS, ignore_eos=True, logprobs=1)
    reference = smollm2_llm.generate(prompts, greedy, use_tqdm=False)
    # 32 blocks of 16 = one max_model_len: these prompts (692 tokens) cannot all fit at once.
    with LLM("smollm2", dtype="float32", max_model_len=512, num_gpu_blocks_override=32,
             max_num_batched_tokens=64, single_process=True) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_engine_idle(llm)
    assert_same_greedy(reference, outs, "real model, 64-token chunks, 32-block pool", REAL_NEW_TOKENS)
