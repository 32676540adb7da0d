"""Seeded sampling is a function of (prompt, params, seed) only: the same tokens alone, inside a busy
mixed batch, with chunked prefill, and across preemptions. Unseeded samples differ from each other."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import tiny_llm
from tokenmill import SamplingParams

TARGET_PROMPT = {"prompt_token_ids": [random.Random(7).randrange(3, 259) for _ in range(37)]}
TARGET = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)
# A second seeded request whose top-k / top-p filters must not depend on the batch either.
FILTERED_PROMPT = {"prompt_token_ids": [random.Random(8).randrange(3, 259) for _ in range(90)]}
FILTERED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)


def busy_batch(vocab_hi: int = 259, n: int = 20, max_len: int = 120, max_tokens: int = 40, seed: int = 0):
    """n other requests: unseeded random, greedy, other seeds, filters; prompts of 1..max_len tokens."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        length = 1 if i == 0 else rng.randrange(2, max_len)
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab_hi) for _ in range(length)]})
        kind = i % 4
        common = dict(max_tokens=rng.randrange(3, max_tokens), ignore_eos=True)
        if kind == 0:
            params.append(SamplingParams(temperature=1.0, **common))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, **common))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.7, seed=rng.randrange(1 << 30), top_k=rng.choice([5, 50]),
                                         **common))
        else:
            params.append(SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, presence_penalty=0.5, **common))
    return prompts, params


def run_in_batch(llm, **batch_kwargs):
    """The target and the filtered request at positions 7 and 15 of the busy batch."""
    prompts, params = busy_batch(**batch_kwargs)
    prompts.insert(7, TARGET_PROMPT)
    params.insert(7, TARGET)
    prompts.insert(15, FILTERED_PROMPT)
    params.insert(15, FILTERED)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs[7].outputs[0].token_ids, outs[15].outputs[0].token_ids


def alone(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def chunked_llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def small_pool_llm(tiny_model_dir):
    # 20 blocks of 16 tokens: one max_model_len (256) request fits; the busy batch does not.
    return tiny_llm(tiny_model_dir, num_gpu_blocks_override=20)


@pytest.fixture(scope="module")
def reference(llm):
    target, filtered = alone(llm, TARGET_PROMPT, TARGET), alone(llm, FILTERED_PROMPT, FILTERED)
    assert len(target) == 24 and len(filtered) == 20
    return target, filtered


def test_seeded_alone_is_reproducible(llm, reference):
    assert alone(llm, TARGET_PROMPT, TARGET) == reference[0]
    assert alone(llm, FILTERED_PROMPT, FILTERED) == reference[1]


def test_seeded_same_inside_a_busy_batch(llm, reference):
    assert run_in_batch(llm) == reference


def test_seeded_same_with_chunked_prefill(chunked_llm, reference):
    assert alone(chunked_llm, TARGET_PROMPT, TARGET) == reference[0]
    steps = chunked_llm.engine.scheduler.step_id
    assert run_in_batch(chunked_llm) == reference
    assert chunked_llm.engine.scheduler.step_id - steps > 40  # the batch really was cut into small steps


def test_seeded_same_across_preemptions(small_pool_llm, reference):
    before = small_pool_llm.engine.scheduler.num_preemptions
    got = run_in_batch(small_pool_llm, max_tokens=120)
    assert small_pool_llm.engine.scheduler.num_preemptions > before, "the small pool never preempted"
    assert got == reference


def test_different_seeds_give_different_samples(llm):
    outs = llm.generate([TARGET_PROMPT] * 5, [SamplingParams(temperature=0.8, seed=s, max_tokens=16, ignore_eos=True)
                                              for s in (1, 2, 3, 1234, 1 << 40)], use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(samples)) == 5, samples
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) == 5


def test_unseeded_samples_in_one_batch_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([TARGET_PROMPT] * 6, params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(samples)) == 6, samples
    # And the next call does not replay the same draws.
    again = [tuple(o.outputs[0].token_ids) for o in llm.generate([TARGET_PROMPT] * 6, params, use_tqdm=False)]
    assert not set(again) & set(samples)


def test_seeded_n_samples_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)
    first = [tuple(c.token_ids) for c in llm.generate(TARGET_PROMPT, params, use_tqdm=False)[0].outputs]
    second = [tuple(c.token_ids) for c in llm.generate(TARGET_PROMPT, params, use_tqdm=False)[0].outputs]
    assert first == second
    assert len(set(first)) == 3


@pytest.mark.slow
def test_real_model_seeded_same_inside_a_busy_batch(smollm2_llm):
    prompt = {"prompt_token_ids": smollm2_llm.get_tokenizer()("Write a short poem about the sea:").input_ids}
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
    expected = alone(smollm2_llm, prompt, params)
    others, other_params = busy_batch(vocab_hi=20000, max_len=100, max_tokens=12, seed=1)
    outs = smollm2_llm.generate(others[:9] + [prompt] + others[9:], other_params[:9] + [params] + other_params[9:],
                                use_tqdm=False)
    assert outs[9].outputs[0].token_ids == expected
    other_seed = alone(smollm2_llm, prompt, SamplingParams(temperature=0.8, seed=4321, max_tokens=12, ignore_eos=True))
    assert other_seed != expected
