"""Async scheduling (two steps in flight, placeholders filled on the device) changes no token.

The reference runs with async scheduling off and every run states its mode; in single-process
runs the worker's placeholder count shows which mode really ran.
"""

from __future__ import annotations

import pytest

from tests.helpers.engine import worker_runner
from tokenmill import LLM, SamplingParams

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=48)
PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "tokenmill " * 9, "zz"]
PLAIN = [0, 1, 2, 4]  # prompts whose params have no penalties and no min_tokens


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=11, max_tokens=28, top_k=20, logprobs=2, min_tokens=5),
    ]


def _plain_params() -> list[SamplingParams]:
    params = [_params()[i] for i in PLAIN]
    params[-1].min_tokens = 0
    return params


def _tokens(outs):
    return [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] for r in outs]


def _run(llm: LLM, prompts, params):
    """Outputs, and how many placeholder inputs the worker filled on the device meanwhile."""
    before = worker_runner(llm).num_placeholders_filled
    outs = _tokens(llm.generate(prompts, params, use_tqdm=False))
    return outs, worker_runner(llm).num_placeholders_filled - before


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Sync, single process: the full batch, and the batch without penalties."""
    with LLM(tiny_model, single_process=True, async_scheduling=False, **ENGINE) as llm:
        full, filled_full = _run(llm, PROMPTS, _params())
        plain, filled_plain = _run(llm, [PROMPTS[i] for i in PLAIN], _plain_params())
    assert filled_full == filled_plain == 0, "the sync reference filled placeholders"
    return full, plain


def test_single_process_async_matches_sync_and_uses_placeholders(tiny_model, reference):
    with LLM(tiny_model, single_process=True, async_scheduling=True, **ENGINE) as llm:
        # Penalties read the previous token on the host: those steps wait for it.
        assert _run(llm, PROMPTS, _params())[0] == reference[0]
        # Without penalties, inputs come from the previous step's sampled ids on the device.
        plain, filled = _run(llm, [PROMPTS[i] for i in PLAIN], _plain_params())
        assert plain == reference[1]
        assert filled > 0, "async scheduling filled no placeholder"
        stats = llm.kv_cache_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_multiprocess_async_matches_sync(tiny_model, reference):
    """The worker is out of reach here; its tokens must still equal the sync reference."""
    with LLM(tiny_model, async_scheduling=True, **ENGINE) as llm:
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference[0]
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == reference[0]
