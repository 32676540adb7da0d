"""The prompt-chunk graph (`PromptGraphs`: a step of one prompt chunk alone) on CPU, its body run
eagerly where CUDA would replay it. Requests run one at a time (so their prefill steps are one
row each) give the plain engine's tokens: prompts of many lengths (padded to the next size),
chunked prefill (several chunks, the later ones over cached context), prefix-cache hits, prompts
too long for any size (eager), and a draft model whose KV the graph must fill too (the target as
its own draft accepts every draft only if it does)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, draft_config, token_ids
from tests.helpers.engine import worker_runner
from tokenmill import SamplingParams
from tokenmill.worker.prompt_graphs import PromptGraphs


def with_eager_prompt_graphs(llm) -> list[int]:
    """Install the graphs (uncaptured: `run` executes the body); returns a count of their runs."""
    runner = worker_runner(llm)
    graphs = PromptGraphs(runner.model, runner.batch, runner.kv_caches, runner.config.model.max_model_len,
                          runner.block_size, runner.config.scheduler.max_num_batched_tokens,
                          mirror=None if runner.draft is None else runner.draft.mirror)
    runs = [0]
    body = graphs._body

    def counted(size: int):
        runs[0] += 1
        return body(size)
    graphs._body = counted
    runner.prompt_graphs = graphs
    return runs


def prompts_of(lengths: list[int], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(5, 250, n).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


def one_at_a_time(llm, prompts, params) -> list[list[int]]:
    return [token_ids(llm, [p], params)[0] for p in prompts]


@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 40}], ids=["whole-prompt", "chunked"])
def test_prefill_through_the_prompt_graph_equals_plain(tiny_model_dir, reference, extra):
    base = prompts_of([150])[0]["prompt_token_ids"]
    prompts = prompts_of([1, 7, 16, 17, 33, 100, 130, 200]) + [
        {"prompt_token_ids": base[:100] + [9, 9, 9]}, {"prompt_token_ids": base + [7]}]  # prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = one_at_a_time(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, max_model_len=256, **extra)
    runs = with_eager_prompt_graphs(llm)
    llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)  # caches the blocks of `base`
    assert one_at_a_time(llm, prompts, params) == want
    assert runs[0] >= len(prompts), runs
    assert llm.scheduler_stats()["prefix_cache_hits"] > 0
    llm.shutdown()


def test_draft_kv_filled_by_the_prompt_graph(tiny_model_dir, reference):
    prompts = prompts_of([20, 45, 90], seed=3)
    llm = tiny_llm(tiny_model_dir, speculative_config=draft_config(tiny_model_dir))
    runs = with_eager_prompt_graphs(llm)
    assert one_at_a_time(llm, prompts, GREEDY) == one_at_a_time(reference, prompts, GREEDY)
    stats = llm.scheduler_stats()
    assert stats["spec_num_draft_tokens"] > 50, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert runs[0] >= len(prompts), runs
    llm.shutdown()
