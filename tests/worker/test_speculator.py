"""The worker's n-gram speculator without a model: histories written once per step (new
requests and released slots in one copy), records of emitted tokens, histories dropped while
dormant and rebuilt on resume (the row's next input appended where a sampled token is still in
flight), and the proposer's graph path (padded to a captured size, the padding proposing for
the scratch slot) equal to the direct path for the real rows, also when the rows are a prefix
of the graphs' own buffer."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers.graphs import use_eager_capture
from tokenmill.config import SpeculativeConfig
from tokenmill.worker.speculator import Speculator


def make(k: int = 3, slots: int = 9, live: bool = True) -> Speculator:
    next_token = torch.arange(100, 100 + slots, dtype=torch.int64)  # slot s's next input: 100 + s
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k), slots, 64, next_token)
    if live:
        spec.resume([])
    return spec


def test_histories_flush_record_and_release() -> None:
    spec = make()
    spec.add(2, [5, 6, 7, 5, 6])
    spec.add(4, [1, 2])
    spec.release(3)
    spec.flush()
    assert spec.history[2, :5].tolist() == [5, 6, 7, 5, 6] and spec.history_len.tolist()[2:5] == [5, 0, 2]
    spec.record_one(torch.tensor([2, 4]), torch.tensor([7, 9]))
    spec.record(torch.tensor([4]), torch.tensor([[3, 4, 99]]), torch.tensor([2]))
    assert spec.history[2, :6].tolist() == [5, 6, 7, 5, 6, 7]
    assert spec.history[4, :5].tolist() == [1, 2, 9, 3, 4] and spec.history_len[4] == 5
    spec.propose(torch.tensor([2]))
    assert spec.drafts[2].tolist() == [5, 6, 7]  # "5 6 7" last seen at the start: 5 6 7 follows it
    spec.release(2)
    spec.flush()
    assert spec.live_slots() == [4]


def test_dormant_histories_hold_nothing_and_resume_from_the_known_tokens() -> None:
    spec = make(live=False)
    spec.add(1, [5, 6, 7])  # dormant: nothing is held, nothing written
    spec.flush()
    assert spec.live_slots() == []
    # Resume: slot 1's sampled token (its next input, 101) is still in flight; slot 3's is known.
    spec.resume([(1, np.array([5, 6, 7]), True), (3, np.array([8, 9]), False)])
    spec.flush()
    assert spec.history[1, :4].tolist() == [5, 6, 7, 101] and spec.history[3, :2].tolist() == [8, 9]
    assert spec.history_len.tolist()[:4] == [0, 4, 0, 2]
    spec.record_one(torch.tensor([1, 3]), torch.tensor([11, 12]))
    assert spec.history[1, :5].tolist() == [5, 6, 7, 101, 11] and spec.history[3, :3].tolist() == [8, 9, 12]
    spec.add(4, [1, 2])  # live again: a new request's history is written
    spec.flush()
    assert spec.live_slots() == [1, 3, 4]
    spec.sleep()
    spec.release(1)  # a request leaving while dormant: nothing to write
    spec.flush()
    assert spec.live_slots() == [] and not spec.live


def test_graph_path_equals_direct_path(monkeypatch) -> None:
    """The real `Speculator.capture` (tests/helpers/graphs.py: eager replays) against proposing directly."""
    phrases = torch.randint(3, 9, (8, 5), generator=torch.Generator().manual_seed(0))
    direct, graphed = make(k=4), make(k=4)
    for spec in (direct, graphed):
        for slot in range(8):
            spec.add(slot, phrases[slot].tolist() * 3)
        spec.flush()
    use_eager_capture(monkeypatch)
    graphed.capture([1, 2, 4, 8], torch.full((8,), 8, dtype=torch.int64))  # the scratch slot: 8
    assert sorted(graphed._graphs) == [1, 2, 4, 8]
    rows = torch.tensor([6, 1, 3])  # padded to 4: one row for the scratch slot
    direct.propose(rows)
    graphed.propose(rows)
    assert direct.drafts[rows].ne(0).any()
    assert torch.equal(graphed.drafts[rows], direct.drafts[rows])
    assert graphed._graph_slots[:4].tolist() == [6, 1, 3, 8]
    # Rows given as a prefix of the buffer itself (the verification graph's rows): nothing copied.
    graphed.drafts.zero_()
    graphed.propose(graphed._graph_slots[:3])
    assert torch.equal(graphed.drafts[rows], direct.drafts[rows])
    assert sum(g.replays for g in graphed._graphs.values()) == 2 and graphed._graphs[4].replays == 2
