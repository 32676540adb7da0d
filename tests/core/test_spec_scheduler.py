"""Speculative decoding in the scheduler, without a model: drafts take budget and KV slots,
rejected ones are taken back, outputs never change, nothing leaks, and the adaptive policy
speculates only where the step has tokens to spare.

The fake worker verifies drafts against the same deterministic next-token function as the
plain runs (`tests/core/fake_worker.py`), accepting them in a fixed pattern, so the expected
output of every request is known independently of the scheduler."""

from __future__ import annotations

import random

import numpy as np

import pytest

from tests.core.fake_worker import EOS, FakeWorker, expected_output
from tests.core.test_scheduler import MAX_LEN, assert_no_leaks, prompts_for, run
from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import FinishReason
from tokenmill.sampling_params import SamplingParams


def spec_scheduler(num_blocks: int, k: int, *, block_size: int = 4, budget: int = 64, max_seqs: int = 16,
                   async_scheduling: bool = False, max_step_tokens: int = 0, caching: bool = True) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_step_tokens=max_step_tokens)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     async_scheduling=async_scheduling),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks, spec)


def half_right(handle: int, position: int) -> bool:
    return (handle * 7 + position) % 3 != 0


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("budget", [5, 16, 8192])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_equal_the_plain_ones(k, budget, async_scheduling):
    prompts = prompts_for(k * 100 + budget, 12)
    max_tokens = [40] * len(prompts)
    scheduler = spec_scheduler(400, k, budget=budget, async_scheduling=async_scheduling)
    worker = FakeWorker(accepts=half_right, block_size=4)
    results = run(scheduler, prompts, max_tokens, in_flight=2 if async_scheduling else 1, worker=worker)
    for handle, prompt in enumerate(prompts):
        tokens, reason = results[handle]
        assert tokens == expected_output(prompt, 40), handle
        assert reason == (FinishReason.STOP if tokens[-1] == EOS else FinishReason.LENGTH)
    assert_no_leaks(scheduler)
    assert worker.num_drafts > 0 and 0 < worker.num_accepted < worker.num_drafts
    stats = scheduler.stats()
    per_position = list(stats.spec_accepted_per_position)
    assert len(per_position) == k and sum(per_position) == stats.spec_num_accepted_tokens, per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position  # j+1 accepted: j was
    if not async_scheduling:  # (async: a request may finish while a step with its drafts is in flight)
        assert stats.spec_num_draft_tokens == worker.num_drafts
        assert stats.spec_num_accepted_tokens == worker.num_accepted
        assert per_position == worker.accepted_per_position + [0] * (k - len(worker.accepted_per_position))


def test_every_draft_right_gives_k_plus_one_tokens_per_step():
    scheduler = spec_scheduler(400, 4)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    run(scheduler, [[20, 21, 22]], [41], worker=worker)  # no EOS among its first 41 tokens
    stats = scheduler.stats()
    # After the prefill step (the first token) every step verifies 4 drafts and keeps them all.
    assert stats.spec_num_drafts == 8 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens == 32


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_one_token_last_chunk_gets_no_drafts(async_scheduling):
    """A prompt one token longer than the budget: its first chunk samples nothing, so the workers
    propose nothing for it; its last chunk (one token, like a decode) must not verify drafts."""
    scheduler = spec_scheduler(400, 3, budget=8, async_scheduling=async_scheduling)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    prompt = list(range(20, 29))
    scheduler.add_request(Request(0, prompt, SamplingParams(max_tokens=12), (EOS,), MAX_LEN))
    first = scheduler.schedule()
    if not async_scheduling:
        scheduler.update(first, worker.execute(first))
    second = scheduler.schedule()  # (async: before the first step's update)
    assert first.propose and first.num_scheduled_tokens == [8]
    assert second.num_scheduled_tokens == [1] and second.num_drafts is None
    steps = [second] if not async_scheduling else [first, second]
    emitted = []
    while steps:
        so = steps.pop(0)
        for out in scheduler.update(so, worker.execute(so)).all_outputs():
            emitted += out.new_token_ids
        if not steps and scheduler.has_unfinished():
            steps.append(scheduler.schedule())
    assert emitted == expected_output(prompt, 12) and worker.num_drafts > 0
    assert_no_leaks(scheduler)


def test_max_tokens_caps_the_drafts():
    """A request never gets more drafts than tokens it may still emit: it never holds a KV slot
    past prompt + max_tokens (so never past max_model_len), and stops at max_tokens exactly."""
    for max_tokens in range(1, 12):
        scheduler = spec_scheduler(400, 5, block_size=1)
        worker = FakeWorker(accepts=lambda h, p: True, block_size=1)
        prompt = [20, 21, 22]
        scheduler.add_request(Request(0, prompt, SamplingParams(max_tokens=max_tokens), (EOS,), MAX_LEN))
        emitted = []
        while scheduler.has_unfinished():
            so = scheduler.schedule()
            assert len(scheduler.kv.blocks[0]) <= len(prompt) + max_tokens
            emitted += scheduler.update(so, worker.execute(so)).all_outputs()[0].new_token_ids
        assert len(emitted) == max_tokens
        assert_no_leaks(scheduler)


def test_preemption_and_aborts_with_drafts_leave_nothing_behind():
    requests = preemptions = aborts = drafts = 0
    for seed in range(60):
        rng = random.Random(seed)
        num_blocks, block_size = rng.randrange(24, 100), rng.choice([1, 2, 4, 16])
        batch = [[rng.randrange(10, 30) for _ in range(rng.randrange(1, 40))] for _ in range(25)]
        batch = [(p, rng.randrange(1, 40)) for p in batch]
        batch = [(p, m) for p, m in batch if -(-(len(p) + m) // block_size) <= num_blocks]
        async_scheduling = rng.random() < 0.5
        scheduler = spec_scheduler(num_blocks, rng.randrange(1, 6), block_size=block_size,
                                   budget=rng.randrange(2, 96), max_seqs=rng.randrange(1, 12),
                                   async_scheduling=async_scheduling, caching=rng.random() < 0.8,
                                   max_step_tokens=rng.choice([0, 0, 8, 32]))
        worker = FakeWorker(accepts=lambda h, p, r=rng.random(): (h * 13 + p * 7) % 10 < r * 10, block_size=block_size)
        results = run(scheduler, [p for p, _ in batch], [m for _, m in batch], abort_prob=0.05, rng=rng,
                      in_flight=2 if async_scheduling else 1, arrive_every=rng.randrange(0, 4), worker=worker)
        for handle, (prompt, mt) in enumerate(batch):
            tokens, reason = results[handle]
            expected = expected_output(prompt, mt)
            assert tokens == (expected[:len(tokens)] if reason == FinishReason.ABORT else expected), (seed, handle)
        assert_no_leaks(scheduler)
        assert not scheduler.table.num_running
        requests += len(batch)
        preemptions += scheduler.num_preemptions
        aborts += sum(1 for _, reason in results.values() if reason == FinishReason.ABORT)
        drafts += worker.num_drafts
    assert requests > 1000 and preemptions > 30 and aborts > 30 and drafts > 3000


def test_saturated_steps_do_not_speculate():
    """With more rows than `max_step_tokens`, no step carries a draft and workers are not asked to propose."""
    scheduler = spec_scheduler(4000, 4, block_size=16, budget=8192, max_seqs=64, max_step_tokens=32)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=16)
    for handle, prompt in enumerate(prompts_for(5, 48)):
        scheduler.add_request(Request(handle, prompt, SamplingParams(max_tokens=30), (EOS,), MAX_LEN))
    proposals = 0
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        proposals += so.propose
        scheduler.update(so, worker.execute(so))
        if scheduler.table.num_running >= 32:
            assert so.num_drafts is None
    assert worker.num_drafts > 0  # once most requests finished, the rest did speculate
    assert_no_leaks(scheduler)


def test_drafts_that_never_pass_are_dropped():
    """Acceptance 0: after a few steps a row gets only an occasional probing draft."""
    scheduler = spec_scheduler(400, 4, max_step_tokens=64)
    worker = FakeWorker(accepts=lambda h, p: False, block_size=4)
    scheduler.add_request(Request(0, [11, 12, 13], SamplingParams(max_tokens=200, ignore_eos=True), (EOS,), MAX_LEN))
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        scheduler.update(so, worker.execute(so))
    stats = scheduler.stats()
    assert stats.spec_num_accepted_tokens == 0
    assert stats.spec_num_draft_tokens < 40, stats  # 200 steps; a non-adaptive k=4 would verify 796 drafts


def test_a_drafting_row_fills_the_tokens_left_under_the_cap():
    """Acceptance about 1/2: only the first positions are worth min_acceptance, but a step under
    `max_step_tokens` costs the same with more tokens, so a drafting row verifies all it has room
    for (probing rows aside: those keep their one draft)."""
    k = 4
    scheduler = spec_scheduler(400, k, max_step_tokens=64)
    worker = FakeWorker(accepts=lambda h, p: p % 2 == 0, block_size=4)
    max_tokens = 120
    scheduler.add_request(Request(0, [11, 12, 13], SamplingParams(max_tokens=max_tokens, ignore_eos=True), (EOS,),
                                  MAX_LEN))
    counts = []
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        if so.num_drafts is not None:
            counts += [int(d) for d in so.num_drafts if d]
        scheduler.update(so, worker.execute(so))
    assert counts and counts.count(k) >= len(counts) - 2, counts  # room near max_tokens aside
    assert_no_leaks(scheduler)


def test_the_no_ranking_shortcut_equals_the_ranking():
    """When the step has tokens for every draft position (small batches), `choose` skips the
    ranking; on random rows (acceptance estimates, room, probing steps) both give the same counts."""
    rng = np.random.default_rng(0)
    k = 4
    policy = spec_scheduler(400, k, max_step_tokens=64).spec
    t = policy.table
    probed = dropped = short = 0
    for trial in range(300):
        n = int(rng.integers(1, 12))
        slots = rng.choice(t.max_rows, n, replace=False)
        t.spec_hits[slots] = rng.uniform(0, 5, n) * rng.integers(0, 2, n)
        t.spec_trials[slots] = t.spec_hits[slots] + rng.uniform(0, 6, n)
        step = 10 + int(rng.integers(0, 16))
        t.spec_ok[slots], t.proposed_at[slots] = True, step - 1
        t.num_tokens[slots], t.num_pending[slots] = 50, 1
        t.num_computed[slots] = 50
        t.token_limit[slots] = 52 + rng.integers(1, k + 3, n)  # room 1 .. k + 2
        shortcut = policy.choose(step, slots, 64)[slots].copy()
        room = np.minimum(t.token_limit[slots] - 52, k)  # (ahead = 51)
        alpha = (t.spec_hits[slots] + 1.0) / (t.spec_trials[slots] + 2.0)
        ranked = policy.ranked_counts(step, slots, alpha, room, 64 - n)
        assert shortcut.tolist() == ranked.tolist(), (trial, alpha, room)
        probed += int(((shortcut == 1) & (alpha < 0.25)).sum())
        dropped += int(((shortcut == 0) & (alpha < 0.25)).sum())
        short += int(((shortcut > 0) & (room < k)).sum())
    assert probed and dropped and short  # every branch of the rule was met


def test_prompt_work_leaves_no_tokens_for_drafts():
    """Tokens under `max_step_tokens` are free for drafts only once every row's own work is
    counted: a prompt waiting for its seat, or a prompt's later chunks, take the step. So a
    step that drafts stays within the cap with its prompt work, and the large chunks go alone."""
    scheduler = spec_scheduler(400, 4, budget=48, max_step_tokens=32)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    scheduler.add_request(Request(0, [11, 12, 13], params, (EOS,), MAX_LEN))
    steps = []
    while scheduler.has_unfinished():
        if len(steps) == 6:  # request 0 drafts by now; a 150-token prompt arrives
            scheduler.add_request(Request(1, list(range(20, 170)), params, (EOS,), MAX_LEN))
        so = scheduler.schedule()
        counts = dict(zip(so.scheduled_handles, so.num_scheduled_tokens))
        drafts = 0 if so.num_drafts is None else int(so.num_drafts.sum())
        steps.append((counts, drafts))
        scheduler.update(so, worker.execute(so))
    assert steps[5][1] > 0  # drafting before the prompt came
    big_chunks = [d for c, d in steps if c.get(1, 0) > 32]
    assert len(big_chunks) == 3 and not any(big_chunks), steps  # (150 tokens: 47 + 47 + 47 + 9)
    assert all(sum(c.values()) <= 32 for c, d in steps if d), steps
    assert sum(d for c, d in steps[-10:]) > 0  # drafting again after the prompt
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("num_requests", [4, 7])
def test_padded_verification_drafts_all_rows_or_none(num_requests):
    """CUDA verification graphs compute 1 + K positions for every row once any row drafts, so
    with `padded_verification` a step drafts only when rows * (1 + K) fits under the cap
    (6 rows * 5 = 30 <= 32 here; 7 rows do not), and then every row takes all its room."""
    k, cap = 4, 32
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_step_tokens=cap, padded_verification=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                          CacheConfig(block_size=4, enable_prefix_caching=True), 400, spec)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    for handle in range(num_requests):
        scheduler.add_request(Request(handle, [11 + handle, 12, 13], SamplingParams(max_tokens=40, ignore_eos=True),
                                      (EOS,), MAX_LEN))
    drafting_steps = all_full = 0
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        running = scheduler.table.num_running
        if so.num_drafts is not None:
            drafting_steps += 1
            assert running * (1 + k) <= cap
            all_full += so.num_drafts.tolist() == [k] * running
        if so.propose:
            assert running * (1 + k) <= cap
        scheduler.update(so, worker.execute(so))
    assert (drafting_steps > 0) == (num_requests * (1 + k) <= cap)
    assert all_full >= drafting_steps - 2  # (near max_tokens a row has room for fewer)
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("num_rows", [6, 7])
def test_padded_verification_choose_counts_the_padding(num_rows):
    """`choose` alone: 6 decode rows * (1 + 4) fit under a cap of 32 and all take k; 7 do not,
    and none drafts, although 25 tokens would be free without the padding."""
    k = 4
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_step_tokens=32, padded_verification=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                          CacheConfig(block_size=4), 400, spec)
    t, slots = scheduler.table, np.arange(num_rows)
    t.spec_ok[slots], t.proposed_at[slots] = True, 9
    t.num_tokens[slots], t.num_pending[slots], t.num_computed[slots] = 50, 1, 50
    t.token_limit[slots], t.spec_hits[slots], t.spec_trials[slots] = 100, 8.0, 8.0
    drafts = scheduler.spec.choose(10, slots, 64)[slots].tolist()
    assert drafts == ([k] * num_rows if num_rows * (1 + k) <= 32 else [0] * num_rows)


def test_no_proposals_while_prompts_wait_for_a_free_seat():
    """Prompts left waiting after a step (the budget ran out, seats are free) take the next
    step's tokens: the workers are not asked to propose for it; once the queue is empty they are."""
    scheduler = spec_scheduler(400, 4, budget=16, max_seqs=8, max_step_tokens=32)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    scheduler.add_request(Request(0, [11, 12, 13], params, (EOS,), MAX_LEN))
    for _ in range(4):  # request 0 decodes, with drafts
        so = scheduler.schedule()
        scheduler.update(so, worker.execute(so))
    for handle in range(1, 6):  # five 12-token prompts: two or three steps of budget 16
        scheduler.add_request(Request(handle, list(range(30 + handle, 42 + handle)), params, (EOS,), MAX_LEN))
    waiting_steps = proposing_steps = 0
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        if scheduler.waiting and scheduler.table.num_running < 8:
            waiting_steps += 1
            assert not so.propose
        proposing_steps += so.propose
        scheduler.update(so, worker.execute(so))
    assert waiting_steps >= 2 and proposing_steps > 5  # (none once no row has room left for a draft)
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_histories_go_dormant_under_load_and_resume_with_the_tokens_in_flight(async_scheduling):
    """Load around the cap: the workers are told to drop the n-gram histories after
    DORMANT_AFTER steps without proposals, and to rebuild them (the core's tokens plus the token
    in flight) when proposing resumes. The fake worker checks every rebuilt and recorded history
    against its own tokens; outputs stay the plain ones."""
    scheduler = spec_scheduler(2000, 3, budget=256, max_seqs=16, async_scheduling=async_scheduling,
                               max_step_tokens=8)
    worker = FakeWorker(accepts=half_right, block_size=4)
    prompts = prompts_for(11, 80)
    max_tokens = [random.Random(i).randrange(10, 40) for i in range(80)]
    results = run(scheduler, prompts, max_tokens, in_flight=2 if async_scheduling else 1, arrive_every=2,
                  worker=worker)
    for handle, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        tokens = expected_output(prompt, mt)
        assert results[handle] == (tokens, FinishReason.STOP if tokens[-1] == EOS else FinishReason.LENGTH)
    assert worker.num_sleeps >= 2 and worker.num_resumes >= 3 and worker.num_drafts > 50, vars(worker)
    assert (worker.num_resumed_in_flight > 0) == async_scheduling, worker.num_resumed_in_flight
    assert_no_leaks(scheduler)


def test_a_queue_too_long_to_draft_drops_the_state_soon():
    """Proposing for two rows, then twenty requests arrive (more than the cap lets draft, counting
    the queue): the proposer's state goes as soon as no drafts are in flight (the third step
    without a proposal), not DORMANT_AFTER steps later."""
    scheduler = spec_scheduler(2000, 3, budget=64, max_seqs=8, max_step_tokens=8)
    worker = FakeWorker(accepts=lambda h, p: True, block_size=4)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for handle in range(2):
        scheduler.add_request(Request(handle, [11 + handle, 12, 13], params, (EOS,), MAX_LEN))
    for _ in range(6):
        so = scheduler.schedule()
        scheduler.update(so, worker.execute(so))
    assert so.propose and worker.histories is not None
    for handle in range(2, 22):
        scheduler.add_request(Request(handle, [30 + handle, 31, 32], params, (EOS,), MAX_LEN))
    dormant = []
    for _ in range(4):
        so = scheduler.schedule()
        dormant.append(so.proposer_dormant)
        scheduler.update(so, worker.execute(so))
    assert dormant == [False, False, True, False] and worker.histories is None
