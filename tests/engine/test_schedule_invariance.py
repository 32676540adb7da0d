"""Greedy outputs do not depend on how the work is scheduled: token budget (chunked prefill),
prefix caching, preemption under a tiny KV pool, async scheduling.

The full matrix runs on a tiny random model with peaky logits (fast) against a reference with
async scheduling off; every variant says whether it schedules asynchronously, and the runner's
placeholder count shows it did. One combined variant (64-token chunks, a KV pool so small that
requests are preempted, prefix caching on, async off) runs on the real model against the shared
engine (async on). The comparison rule is in tests/helpers/invariance.py; the last test shows
that it fails on one wrong token.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.helpers.engine import worker_runner
from tests.helpers.invariance import assert_same_greedy, greedy_params
from tests.helpers.tiny_models import make_tiny_model_dir
from tests.helpers.wrong_token import inject_wrong_token
from tokenmill import LLM

NEW_TOKENS = 32
GREEDY = greedy_params(NEW_TOKENS)


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


def assert_async_as_asked(llm: LLM, async_scheduling: bool) -> None:
    """Async runs take inputs from the device (placeholders); sync runs never do."""
    filled = worker_runner(llm).num_placeholders_filled
    assert (filled > 0) if async_scheduling else (filled == 0), f"{filled} placeholders filled"


# ---------------------------------------------------------------- tiny model matrix

TINY_LENGTHS = [5, 9, 16, 17, 31, 48, 64, 95, 128, 150, 190, 200]
SYNC, ASYNC = dict(async_scheduling=False), dict(async_scheduling=True)
TINY_VARIANTS = {
    "chunk16": dict(SYNC, max_num_batched_tokens=16),
    "chunk64": dict(SYNC, max_num_batched_tokens=64),
    "chunk24-unaligned": dict(SYNC, max_num_batched_tokens=24),
    "no-prefix-cache": dict(SYNC, enable_prefix_caching=False),
    "chunk16-no-prefix-cache": dict(SYNC, max_num_batched_tokens=16, enable_prefix_caching=False),
    "preempt": dict(SYNC, num_gpu_blocks_override=16, max_num_batched_tokens=64),
    "preempt-no-prefix-cache": dict(SYNC, num_gpu_blocks_override=16, enable_prefix_caching=False),
    "max-num-seqs-3": dict(SYNC, max_num_seqs=3, max_num_batched_tokens=32),
    "async": dict(ASYNC, max_num_batched_tokens=64),
    "async-chunk16": dict(ASYNC, max_num_batched_tokens=16),
    "async-preempt": dict(ASYNC, num_gpu_blocks_override=16, max_num_batched_tokens=64),
    "async-max-num-seqs-3": dict(ASYNC, max_num_seqs=3, max_num_batched_tokens=32),
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
    llm = tiny_llm(peaky_dir, async_scheduling=False)
    outs = llm.generate(tiny_prompts, GREEDY, use_tqdm=False)
    assert_async_as_asked(llm, False)
    return outs


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_greedy_is_schedule_invariant(peaky_dir, tiny_prompts, tiny_reference, variant):
    llm = tiny_llm(peaky_dir, **TINY_VARIANTS[variant])
    outs = llm.generate(tiny_prompts, GREEDY, use_tqdm=False)
    assert_same_greedy(tiny_reference, outs, variant, NEW_TOKENS)
    assert_async_as_asked(llm, TINY_VARIANTS[variant]["async_scheduling"])
    scheduler = llm.engine.scheduler
    if "preempt" in variant:
        assert scheduler.num_preemptions > 0, "the tiny pool never preempted"
    if "chunk16" in variant:
        assert scheduler.step_id >= sum(len(p["prompt_token_ids"]) for p in tiny_prompts) // 16
    if TINY_VARIANTS[variant].get("enable_prefix_caching", True):
        # Again, now that the prompts are cached: the hits must give the same tokens.
        hits = scheduler.kv.stats.hits
        again = llm.generate(tiny_prompts, GREEDY, use_tqdm=False)
        assert_same_greedy(tiny_reference, again, variant + " again", NEW_TOKENS)
        if "preempt" not in variant:
            assert scheduler.kv.stats.hits > hits
    assert_engine_idle(llm)


@pytest.mark.parametrize("variant", ["chunk64", "async"])
def test_one_wrong_token_fails_the_check(peaky_dir, tiny_prompts, tiny_reference, variant, monkeypatch):
    """The check above can fail: one token replaced by its runner-up at a clear margin."""
    llm = tiny_llm(peaky_dir, **TINY_VARIANTS[variant])
    fault = inject_wrong_token(monkeypatch, llm)
    outs = llm.generate(tiny_prompts, GREEDY, use_tqdm=False)
    assert fault.gap is not None and fault.gap > 0.1, "no token was replaced"
    with pytest.raises(AssertionError, match="differs at token"):
        assert_same_greedy(tiny_reference, outs, variant, NEW_TOKENS)


def _made_up(tokens: list[int], gap: float):
    """A RequestOutput-shaped record: greedy tokens, each position's top-2 logprobs `gap` apart."""
    from types import SimpleNamespace
    rows = [{t: SimpleNamespace(logprob=0.0), t + 1: SimpleNamespace(logprob=-gap)} for t in tokens]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=rows, finish_reason="length")])


def test_near_ties_are_capped_and_every_prompt_is_checked():
    """Made-up outputs: a near-tie divergence passes up to one per 16 prompts (rounded up); the
    failure names every diverging prompt, not only the first."""
    from tests.helpers.invariance import NEAR_TIE
    tie, clear = _made_up([1, 2], NEAR_TIE / 2), _made_up([1, 2], 0.5)
    diverged = _made_up([1, 3], 0.5)
    assert len(assert_same_greedy([tie] * 6, [diverged] + [tie] * 5, "1 in 6", 2)) == 1
    assert len(assert_same_greedy([tie] * 17, [diverged] * 2 + [tie] * 15, "2 in 17", 2)) == 2
    with pytest.raises(AssertionError, match="2 near-tie divergences in 6 prompts, at most 1"):
        assert_same_greedy([tie] * 6, [diverged] * 2 + [tie] * 4, "2 in 6", 2)
    with pytest.raises(AssertionError, match=r"(?s)prompt 0 differs.*prompt 2 differs"):
        assert_same_greedy([clear] * 3, [diverged, clear, diverged], "clear margins", 2)


# ---------------------------------------------------------------- the real model

REAL_LENGTHS = [5, 47, 130, 210, 300]
REAL_NEW_TOKENS = 16


@pytest.mark.slow
def test_real_model_chunked_preempted_matches_shared_engine(smollm2_llm):
    """Reference: the shared engine (async on, room for all); variant: async off, chunks, preemption."""
    tokenizer = smollm2_llm.get_tokenizer()
    text = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep and sings "
            "an old song about rivers, mountains, cities and the sea. ") * 40
    ids = tokenizer(text).input_ids
    rng = random.Random(5)
    prompts = []
    for i, n in enumerate(REAL_LENGTHS):
        start = 0 if i % 2 else rng.randrange(1, 200)  # odd prompts share the text's beginning
        prompts.append({"prompt_token_ids": ids[start:start + n]})
    greedy = greedy_params(REAL_NEW_TOKENS)
    filled = worker_runner(smollm2_llm).num_placeholders_filled
    reference = smollm2_llm.generate(prompts, greedy, use_tqdm=False)
    assert worker_runner(smollm2_llm).num_placeholders_filled > filled, "the shared engine ran sync"
    # 32 blocks of 16 = one max_model_len: these prompts (692 tokens) cannot all fit at once.
    with LLM("smollm2", dtype="float32", max_model_len=512, num_gpu_blocks_override=32,
             max_num_batched_tokens=64, async_scheduling=False, single_process=True) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_async_as_asked(llm, False)
        assert_engine_idle(llm)
    assert_same_greedy(reference, outs, "real model, 64-token chunks, 32-block pool, sync", REAL_NEW_TOKENS)
