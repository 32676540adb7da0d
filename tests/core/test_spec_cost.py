"""The adaptive policy's measured cost of speculating, without a model: step times kept per
padded batch size and regime, the break-even rule (expected accepted drafts against the extra
time of a speculative step), and the scheduler asking for proposals only where they pay, with
the other regime measured once where the choice is close."""

from __future__ import annotations


import numpy as np
import pytest

from tests.core.fake_worker import EOS, FakeWorker
from tests.core.test_scheduler import MAX_LEN, assert_no_leaks
from tests.core.test_spec_scheduler import spec_scheduler
from tokenmill.core.request import Request
from tokenmill.core.spec_cost import PRIOR_RATIO, REFRESH_STEPS, StepCosts
from tokenmill.sampling_params import SamplingParams


def test_step_costs_per_padded_size_and_regime():
    costs = StepCosts(64)
    assert costs.ratio(5) == PRIOR_RATIO and costs.stale(True, 5, 0)
    costs.observe(False, 5, 1.0, step_id=10)  # 5 rows: padded to 8, with 6 and 7
    assert costs.ratio(7) == PRIOR_RATIO  # one regime measured: still the prior
    costs.observe(True, 6, 2.0, step_id=11)
    assert costs.ratio(8) == pytest.approx(2.0) and costs.ratio(9) == PRIOR_RATIO  # 9 pads to 16
    costs.observe(True, 8, 1.0, step_id=12)  # a running mean: 2.0 + 0.2 * (1.0 - 2.0)
    assert costs.ratio(5) == pytest.approx(1.8)
    assert not costs.stale(True, 5, 12 + REFRESH_STEPS) and costs.stale(True, 5, 13 + REFRESH_STEPS)


def test_expected_gain_is_the_sum_of_acceptance_powers():
    scheduler = spec_scheduler(400, 4, max_step_tokens=32)
    for handle, (hits, trials, limit) in enumerate([(6.0, 7.0, 100), (0.0, 6.0, 100), (3.0, 4.0, 13)]):
        scheduler.add_request(Request(handle, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=limit),
                                      (EOS,), MAX_LEN))
    scheduler.schedule()
    t = scheduler.table
    rows = t.order
    t.spec_hits[rows], t.spec_trials[rows] = [6.0, 0.0, 3.0], [7.0, 6.0, 4.0]
    room = [4, 4, 13 + 10 - 10 - 1 - 1]  # the third may add 3 more tokens, one of them this step's
    want = 0.0
    for hits, trials, r in zip([6.0, 0.0, 3.0], [7.0, 6.0, 4.0], room):
        alpha = (hits + 1) / (trials + 2)
        if alpha >= 0.25:  # below the line: no drafts
            want += sum(alpha ** j for j in range(1, min(r, 4) + 1))
    assert scheduler.spec.expected_gain(rows) == pytest.approx(want)


def drive(ratio: float, accepts, steps_wanted: int = 400) -> tuple[list[bool], FakeWorker]:
    """Four long requests under a cap that always leaves room: each step's time is 1 s plain and
    `ratio` s when it verifies drafts (fed back as the engine core does). Returns whether each
    step asked for proposals."""
    scheduler = spec_scheduler(4000, 4, budget=256, max_seqs=8, max_step_tokens=64)
    worker = FakeWorker(accepts=accepts, block_size=4)
    for handle in range(4):
        scheduler.add_request(Request(handle, [11 + handle, 12, 13], SamplingParams(max_tokens=steps_wanted,
                                                                                   ignore_eos=True), (EOS,), MAX_LEN))
    proposed = []
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        proposed.append(so.propose)
        scheduler.update(so, worker.execute(so))
        scheduler.observe_step(so, ratio if so.num_drafts is not None else 1.0)
    assert_no_leaks(scheduler)
    return proposed, worker


def test_speculation_stops_where_it_costs_more_than_it_gains():
    """Half the drafts right (a row's expected gain about 1.5 tokens per step, 6 for four rows):
    at 2.5x the plain step's time (need: 1.5 x 4 = 6 tokens) nothing but the measurements; at
    1.2x (need 0.8) every step drafts."""
    half = lambda handle, position: (handle + position) % 2 == 0  # noqa: E731
    cheap, _ = drive(1.2, half)
    assert np.mean(cheap[10:]) > 0.95
    costly, worker = drive(2.5, half)
    late = costly[len(costly) // 3:]
    assert np.mean(late) < 0.05, costly  # measured once per REFRESH_STEPS at most
    assert worker.num_drafts > 0  # it tried, on the prior's word, then measured


def test_the_other_regime_is_measured_where_untried_or_close_and_stale():
    """A regime never measured at a batch size is tried for two steps (the second a clean
    measurement); later only where gain and need are within a factor of two and its measurement
    is older than REFRESH_STEPS; never where no row is expected to accept anything."""
    scheduler = spec_scheduler(400, 4, max_step_tokens=64)
    policy = scheduler.spec
    scheduler.add_request(Request(0, [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), (EOS,), MAX_LEN))
    so = scheduler.schedule()  # the prior alpha (1/2) pays, but a plain step was never measured: try it
    assert not so.propose and policy._trying == (2, False)
    assert [policy._pays(2), policy._pays(3)] == [False, True]
    t = scheduler.table
    later = 3 + REFRESH_STEPS + 1
    t.spec_hits[t.order], t.spec_trials[t.order] = 0.0, 6.0  # alpha 1/8, below the line: expects nothing
    assert not policy._pays(later)
    t.spec_hits[t.order], t.spec_trials[t.order] = 9.0, 10.0  # alpha 5/6: gain 2.9 against need 0.3
    assert policy._pays(later)
    t.spec_hits[t.order], t.spec_trials[t.order] = 0.0, 1.0  # alpha 1/3: gain 0.49, close to 0.3: measure plain again
    assert [policy._pays(later + 1), policy._pays(later + 2), policy._pays(later + 3)] == [False, False, True]
