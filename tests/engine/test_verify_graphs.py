"""The speculative verification graph (`DecodeGraphs` with query_len = k + 1) on CPU, built by
the real `ModelRunner.capture_graphs` with an eager replay (tests/helpers/graphs.py: each replay
runs the captured body): n-gram speculation through it gives the plain engine's tokens, with rows
verifying fewer drafts than k (padding that writes no KV), rows without drafts, padded batch
sizes, batches too large for it (eager steps between), and the end of max_model_len. All-greedy
steps end in the greedy step-end graph (greedy_tail.py); with a draft model, the graphs mirror
the step into the draft's KV and greedy proposals replay the draft's own graph."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, NGRAM, repetitive_prompts, token_ids
from tests.helpers.engine import pin_spec_cost
from tests.helpers.graphs import capture_real_graphs, replays
from tokenmill import SamplingParams

# Few graph sizes keep the capture short on CPU (each size's body runs twice while capturing).
GRAPHED = dict(max_num_seqs=8, max_num_batched_tokens=128)


SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=40, ignore_eos=True)


def tail_replays(runner) -> int:
    return sum(replays(t) for t in (runner.graph_tail, runner.recording_tail, runner.verify_tail))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("batch", ["greedy", "with-seeded"])
def test_greedy_through_the_verification_graph_equals_plain(tiny_model_dir, reference, async_scheduling, batch,
                                                            monkeypatch):
    """7 rows: padded to 8. All greedy: steps end in the greedy tails; one seeded row among them:
    the verification graph's logits go through the sampler."""
    prompts = repetitive_prompts(7, seed=3)
    params = GREEDY if batch == "greedy" else [GREEDY] * 6 + [SEEDED]
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling,
                   speculative_config={**NGRAM, "max_step_tokens": 0}, **GRAPHED)
    runner = capture_real_graphs(llm, monkeypatch)
    assert token_ids(llm, prompts, params) == want
    stats = llm.scheduler_stats()
    assert replays(runner.verify_graphs) > 10 and stats["spec_num_accepted_tokens"] > 0, stats
    assert replays(runner.speculator) > 10  # the n-gram proposer's graphs
    assert (tail_replays(runner) > 10) == (batch == "greedy"), tail_replays(runner)
    llm.shutdown()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_target_as_draft_through_the_graphs(tiny_model_dir, reference, sampling, monkeypatch):
    """A draft model: decode and verification graphs mirror each step into the draft's KV (the
    target as its own draft accepts every draft only if that KV is right); greedy steps end in
    the greedy tail and propose through the draft's graphs, seeded ones sample eagerly."""
    from tests.engine.test_speculative import draft_config
    prompts = repetitive_prompts(4, seed=6)
    params = GREEDY if sampling == "greedy" else [
        SamplingParams(temperature=0.8, top_k=40, seed=3 + i, max_tokens=30, ignore_eos=True) for i in range(4)]
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, speculative_config=draft_config(tiny_model_dir), **GRAPHED)
    runner = capture_real_graphs(llm, monkeypatch)
    assert token_ids(llm, prompts, params) == want
    stats = llm.scheduler_stats()
    assert stats["spec_num_draft_tokens"] > 50, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert replays(runner.verify_graphs) > 5
    greedy = sampling == "greedy"
    assert (replays(runner.draft) > 5 and tail_replays(runner) > 5) == greedy, (replays(runner.draft),
                                                                               tail_replays(runner))
    llm.shutdown()


def test_uneven_drafts_seeds_and_large_batches(tiny_model_dir, reference, monkeypatch):
    """Adaptive drafts (rows verify 0..k), seeded sampling, a penalty row (never drafts), batches
    larger than the graph's (eager), and rows reaching max_model_len (eager near the end)."""
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=16 + 8 * i, ignore_eos=True)
              for i in range(5)] + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                   repetition_penalty=1.2)]  # the batch shrinks below 4
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, speculative_config={**NGRAM, "max_step_tokens": 8}, **GRAPHED)
    pin_spec_cost(llm)
    runner = capture_real_graphs(llm, monkeypatch, verify_rows=4)
    assert token_ids(llm, prompts, params) == want
    assert replays(runner.verify_graphs) > 2
    llm.shutdown()


def test_max_model_len_edge(tiny_model_dir, monkeypatch):
    """Requests that run to max_model_len: the last steps have no room for k + 1 positions."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 24 + 40 = max_model_len
    plain = tiny_llm(tiny_model_dir, async_scheduling=False, max_model_len=64)
    want = token_ids(plain, prompts, params)
    plain.shutdown()
    llm = tiny_llm(tiny_model_dir, max_model_len=64, speculative_config={**NGRAM, "max_step_tokens": 0}, **GRAPHED)
    runner = capture_real_graphs(llm, monkeypatch, verify_rows=2)
    assert token_ids(llm, prompts, params) == want and len(want[0]) == 64 - 24
    assert replays(runner.verify_graphs) > 0 and tail_replays(runner) > 0
    llm.shutdown()
