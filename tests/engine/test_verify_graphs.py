"""The speculative verification graph (`DecodeGraphs` with query_len = k + 1) on CPU: its body
run eagerly where CUDA would replay it. n-gram speculation through it gives the plain engine's
tokens, with rows verifying fewer drafts than k (padding that writes no KV), rows without drafts,
padded batch sizes, batches too large for it (eager steps between), and the end of max_model_len."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, NGRAM, repetitive_prompts, token_ids
from tests.helpers.engine import worker_runner
from tokenmill import SamplingParams
from tokenmill.worker.decode_graphs import DecodeGraphs


class _EagerReplay:
    """Stands in for a captured graph: a replay runs the captured body itself."""

    def __init__(self, graphs: DecodeGraphs, size: int, counter: list[int]) -> None:
        self.graphs, self.size, self.counter = graphs, size, counter

    def replay(self) -> None:
        self.graphs.logits[self.size] = self.graphs._body(self.size)
        self.counter[0] += 1


def with_eager_verify_graphs(llm, max_rows: int) -> list[int]:
    runner = worker_runner(llm)
    graphs = DecodeGraphs(runner.model, runner.batch, runner.kv_caches, max_rows, runner.config.model.max_model_len,
                          runner.block_size, query_len=runner.speculator.k + 1, drafts=runner.speculator.drafts)
    replays = [0]
    graphs.graphs = {size: _EagerReplay(graphs, size, replays) for size in graphs.sizes}
    runner.verify_graphs = graphs
    return replays


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_through_the_verification_graph_equals_plain(tiny_model_dir, reference, async_scheduling):
    prompts = repetitive_prompts(7, seed=3)  # 7 rows: padded to 8, and more than max_rows=4 at first
    want = token_ids(reference, prompts, GREEDY)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling,
                   speculative_config={**NGRAM, "max_step_tokens": 0})
    replays = with_eager_verify_graphs(llm, max_rows=8)
    assert token_ids(llm, prompts, GREEDY) == want
    stats = llm.scheduler_stats()
    assert replays[0] > 10 and stats["spec_num_accepted_tokens"] > 0, (replays, stats)
    llm.shutdown()


def test_uneven_drafts_seeds_and_large_batches(tiny_model_dir, reference):
    """Adaptive drafts (rows verify 0..k), seeded sampling, a penalty row (never drafts), batches
    larger than the graph's (eager), and rows reaching max_model_len (eager near the end)."""
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=16 + 8 * i, ignore_eos=True)
              for i in range(5)] + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                   repetition_penalty=1.2)]  # the batch shrinks below 4
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, speculative_config={**NGRAM, "max_step_tokens": 8})
    replays = with_eager_verify_graphs(llm, max_rows=4)
    assert token_ids(llm, prompts, params) == want
    assert replays[0] > 2, replays
    llm.shutdown()


def test_max_model_len_edge(tiny_model_dir):
    """Requests that run to max_model_len: the last steps have no room for k + 1 positions."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 24 + 40 = max_model_len
    plain = tiny_llm(tiny_model_dir, async_scheduling=False, max_model_len=64)
    want = token_ids(plain, prompts, params)
    plain.shutdown()
    llm = tiny_llm(tiny_model_dir, max_model_len=64, speculative_config={**NGRAM, "max_step_tokens": 0})
    replays = with_eager_verify_graphs(llm, max_rows=2)
    assert token_ids(llm, prompts, params) == want and len(want[0]) == 64 - 24
    assert replays[0] > 0
    llm.shutdown()
