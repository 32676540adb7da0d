"""The prompt-chunk graph (`PromptGraphs`: a step of one prompt chunk alone) on CPU, built by the
real `ModelRunner.capture_graphs` with an eager replay (tests/helpers/graphs.py). Requests run one at a time (so their prefill steps are one
row each) give the plain engine's tokens: prompts of many lengths (padded to the next size),
chunked prefill (several chunks, the later ones over cached context), prefix-cache hits, prompts
too long for any size (eager), and a draft model whose KV the graph must fill too (the target as
its own draft accepts every draft only if it does)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, draft_config, token_ids
from tests.helpers.graphs import capture_real_graphs, replays
from tokenmill import SamplingParams

SMALL = dict(max_num_seqs=8)  # few decode graph sizes: a short capture on CPU


def prompts_of(lengths: list[int], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(5, 250, n).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


def one_at_a_time(llm, prompts, params) -> list[list[int]]:
    return [token_ids(llm, [p], params)[0] for p in prompts]


@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 40}], ids=["whole-prompt", "chunked"])
def test_prefill_through_the_prompt_graph_equals_plain(tiny_model_dir, reference, extra, monkeypatch):
    base = prompts_of([150])[0]["prompt_token_ids"]
    prompts = prompts_of([1, 7, 16, 17, 33, 100, 130, 200]) + [
        {"prompt_token_ids": base[:100] + [9, 9, 9]}, {"prompt_token_ids": base + [7]}]  # prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = one_at_a_time(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, max_model_len=256, **SMALL, **extra)
    runner = capture_real_graphs(llm, monkeypatch)
    llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)  # caches the blocks of `base`
    assert one_at_a_time(llm, prompts, params) == want
    assert replays(runner.prompt_graphs) >= len(prompts)
    assert llm.scheduler_stats()["prefix_cache_hits"] > 0
    llm.shutdown()


def test_draft_kv_filled_by_the_prompt_graph(tiny_model_dir, reference, monkeypatch):
    prompts = prompts_of([20, 45, 90], seed=3)
    llm = tiny_llm(tiny_model_dir, speculative_config=draft_config(tiny_model_dir), **SMALL)
    runner = capture_real_graphs(llm, monkeypatch)
    assert one_at_a_time(llm, prompts, GREEDY) == one_at_a_time(reference, prompts, GREEDY)
    stats = llm.scheduler_stats()
    assert stats["spec_num_draft_tokens"] > 50, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert replays(runner.prompt_graphs) >= len(prompts)
    llm.shutdown()
