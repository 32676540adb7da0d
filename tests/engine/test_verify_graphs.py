"""The speculative verification graph (`DecodeGraphs` with query_len = k + 1) on CPU: its body
run eagerly where CUDA would replay it. n-gram speculation through it gives the plain engine's
tokens, with rows verifying fewer drafts than k (padding that writes no KV), rows without drafts,
padded batch sizes, batches too large for it (eager steps between), and the end of max_model_len.
With `tails`, all-greedy steps end in the greedy step-end graph (greedy_tail.py) too; with a
draft model, the graphs mirror the step into the draft's KV and greedy proposals replay the
draft's own graph."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, NGRAM, repetitive_prompts, token_ids
from tests.helpers.engine import pin_spec_cost, worker_runner
from tokenmill import SamplingParams
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.greedy_tail import GreedyTail


class _EagerReplay:
    """Stands in for a captured graph: a replay runs the captured body itself."""

    def __init__(self, body, counter: list[int]) -> None:
        self.body, self.counter = body, counter

    def replay(self) -> None:
        self.body()
        self.counter[0] += 1


def _eager_graphs(runner, max_rows: int, query_len: int, counter: list[int], draft_kv: bool = False) -> DecodeGraphs:
    """As ModelRunner.capture_graphs makes them: the verification family mirrors into a draft's
    KV; plain decode does not (`draft_kv`: the draft's own kv-only family does)."""
    draft = runner.draft
    mirror = draft.mirror if draft is not None and query_len > 1 else None
    model, caches = (draft.model, draft.kv_caches) if draft_kv else (runner.model, runner.kv_caches)
    graphs = DecodeGraphs(model, runner.batch, caches, max_rows, runner.config.model.max_model_len,
                          runner.block_size, query_len=query_len, drafts=runner.speculator.drafts, mirror=mirror,
                          kv_only=draft_kv)

    def body(size: int):
        graphs.logits[size] = graphs._body(size)
    graphs.graphs = {size: _EagerReplay(lambda size=size: body(size), counter) for size in graphs.sizes}
    return graphs


class _CountingTail(GreedyTail):
    def __init__(self, graphs, batch, speculator, counter: list[int]) -> None:
        super().__init__(graphs, batch, speculator)
        self.counter = counter

    def body(self, size: int):
        self.counter[0] += 1
        return super().body(size)


def with_eager_verify_graphs(llm, max_rows: int, tails: bool = False, decode: bool = False) -> dict[str, list[int]]:
    """Install eager stand-ins of the verification graphs (and with `decode` the plain decode
    graphs; with `tails` both families' greedy step-end graphs; with a draft model its greedy
    proposal graphs). Returns replay counters by family."""
    runner = worker_runner(llm)
    counts = {name: [0] for name in ("verify", "decode", "tail", "draft", "draft_kv")}
    runner.verify_graphs = _eager_graphs(runner, max_rows, runner.speculator.k + 1, counts["verify"])
    if decode:
        runner.graphs = _eager_graphs(runner, max_rows, 1, counts["decode"])
        if runner.draft is not None:
            runner.draft_graphs = _eager_graphs(runner, max_rows, 1, counts["draft_kv"], draft_kv=True)
    if tails:  # as ModelRunner.capture_graphs makes them
        histories = runner.speculator if runner.speculator.keeps_histories else None
        runner.verify_tail = _CountingTail(runner.verify_graphs, runner.batch, histories, counts["tail"])
        if decode:
            runner.graph_tail = _CountingTail(runner.graphs, runner.batch, None, counts["tail"])
            if histories is not None:
                runner.recording_tail = _CountingTail(runner.graphs, runner.batch, histories, counts["tail"])
    draft = runner.draft
    if draft is not None:
        draft._graph_slots = runner.verify_graphs.slots  # as captured: the verification rows' buffer
        args = runner._draft_inputs()
        draft._graphs = {size: _EagerReplay(lambda size=size: draft._steps(None, draft._graph_slots[:size], *args,
                                                                           False), counts["draft"])
                         for size in runner.verify_graphs.sizes}
    return counts


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("tails", [False, True], ids=["sampler", "greedy-tail"])
def test_greedy_through_the_verification_graph_equals_plain(tiny_model_dir, reference, async_scheduling, tails):
    prompts = repetitive_prompts(7, seed=3)  # 7 rows: padded to 8, and more than max_rows=4 at first
    want = token_ids(reference, prompts, GREEDY)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling,
                   speculative_config={**NGRAM, "max_step_tokens": 0})
    replays = with_eager_verify_graphs(llm, max_rows=8, tails=tails, decode=tails)
    assert token_ids(llm, prompts, GREEDY) == want
    stats = llm.scheduler_stats()
    assert replays["verify"][0] > 10 and stats["spec_num_accepted_tokens"] > 0, (replays, stats)
    assert (replays["tail"][0] > 10) == tails, replays
    llm.shutdown()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_target_as_draft_through_the_graphs(tiny_model_dir, reference, sampling):
    """A draft model: decode and verification graphs mirror each step into the draft's KV (the
    target as its own draft accepts every draft only if that KV is right); greedy steps end in
    the greedy tail and propose through the draft's graphs, seeded ones sample eagerly."""
    from tests.engine.test_speculative import draft_config
    prompts = repetitive_prompts(4, seed=6)
    params = GREEDY if sampling == "greedy" else [
        SamplingParams(temperature=0.8, top_k=40, seed=3 + i, max_tokens=30, ignore_eos=True) for i in range(4)]
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, speculative_config=draft_config(tiny_model_dir))
    replays = with_eager_verify_graphs(llm, max_rows=4, tails=True, decode=True)
    assert token_ids(llm, prompts, params) == want
    stats = llm.scheduler_stats()
    assert stats["spec_num_draft_tokens"] > 50, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert replays["verify"][0] > 5, replays
    assert (replays["draft"][0] > 5 and replays["tail"][0] > 5) == (sampling == "greedy"), replays
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
    pin_spec_cost(llm)
    replays = with_eager_verify_graphs(llm, max_rows=4)
    assert token_ids(llm, prompts, params) == want
    assert replays["verify"][0] > 2, replays
    llm.shutdown()


def test_max_model_len_edge(tiny_model_dir):
    """Requests that run to max_model_len: the last steps have no room for k + 1 positions."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 24 + 40 = max_model_len
    plain = tiny_llm(tiny_model_dir, async_scheduling=False, max_model_len=64)
    want = token_ids(plain, prompts, params)
    plain.shutdown()
    llm = tiny_llm(tiny_model_dir, max_model_len=64, speculative_config={**NGRAM, "max_step_tokens": 0})
    replays = with_eager_verify_graphs(llm, max_rows=2, tails=True, decode=True)
    assert token_ids(llm, prompts, params) == want and len(want[0]) == 64 - 24
    assert replays["verify"][0] > 0 and replays["tail"][0] > 0
    llm.shutdown()
