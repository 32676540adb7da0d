"""Async scheduling (two steps in flight, placeholders filled on the device) changes no token."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=48)
PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "tokenmill " * 9, "zz"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=11, max_tokens=28, top_k=20, logprobs=2, min_tokens=5),
    ]


def _tokens(outs):
    return [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] for r in outs]


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(tiny_model, single_process=True, async_scheduling=False, **ENGINE) as llm:
        return _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))


def test_single_process_async_matches_sync_and_uses_placeholders(tiny_model, reference):
    with LLM(tiny_model, single_process=True, async_scheduling=True, **ENGINE) as llm:
        # Penalties read the previous token on the host: those steps wait for it.
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference
        # Without penalties, inputs come from the previous step's sampled ids on the device.
        plain = [0, 1, 2, 4]
        params = [_params()[i] for i in plain]
        params[-1].min_tokens = 0
        with LLM(tiny_model, single_process=True, **ENGINE) as sync:
            expected = _tokens(sync.generate([PROMPTS[i] for i in plain], params, use_tqdm=False))
        assert _tokens(llm.generate([PROMPTS[i] for i in plain], params, use_tqdm=False)) == expected
        assert llm.engine.executor.worker.runner.num_placeholders_filled > 0
        stats = llm.kv_cache_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_multiprocess_async_matches_sync(tiny_model, reference):
    with LLM(tiny_model, async_scheduling=True, **ENGINE) as llm:
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference
