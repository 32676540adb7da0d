"""Scheduler + KV manager without a model: outputs independent of the schedule, and no leaks."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.fake_worker import EOS, FakeWorker, expected_output
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import FinishReason
from tokenmill.sampling_params import SamplingParams

MAX_LEN = 256


def make_scheduler(num_blocks: int, block_size: int = 4, budget: int = 64, max_seqs: int = 16,
                   caching: bool = True, async_scheduling: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     async_scheduling=async_scheduling),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)


def run(scheduler: Scheduler, prompts: list[list[int]], max_tokens: list[int], *,
        abort_prob: float = 0.0, rng: random.Random | None = None, in_flight: int = 1,
        arrive_every: int = 0, worker: FakeWorker | None = None) -> dict[int, tuple[list[int], FinishReason]]:
    """Drive the scheduler like EngineCore does; return handle -> (output tokens, finish reason).

    Pass the same `worker` to every run on one scheduler: it mirrors the scheduler's batch."""
    rng = rng or random.Random(0)
    worker = worker or FakeWorker()
    results: dict[int, tuple[list[int], FinishReason]] = {}
    outputs: dict[int, list[int]] = {}
    pending = list(enumerate(zip(prompts, max_tokens)))
    queue = []
    steps = 0

    def admit(count: int) -> None:
        for _ in range(count):
            if pending:
                handle, (prompt, mt) = pending.pop(0)
                scheduler.add_request(Request(handle, prompt, SamplingParams(max_tokens=mt), (EOS,), MAX_LEN))
                outputs[handle] = []

    admit(len(pending) if not arrive_every else 1)
    while scheduler.has_unfinished() or queue or pending:
        steps += 1
        assert steps < 20000, "scheduler made no progress"
        if arrive_every and steps % arrive_every == 0:
            admit(1)
        while len(queue) < in_flight:
            so = scheduler.schedule()
            if so is None:
                break
            queue.append((so, worker.execute(so)))
        if not queue:
            admit(1)
            continue
        so, out = queue.pop(0)
        for o in scheduler.update(so, out).all_outputs():
            outputs[o.handle].extend(o.new_token_ids)
            if o.finish_reason is not None:
                results[o.handle] = (outputs[o.handle], o.finish_reason)
        worker.check_mirrors(scheduler, scheduler.block_size)
        if abort_prob and scheduler.requests and rng.random() < abort_prob:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort([victim])
            results[victim] = (outputs[victim], FinishReason.ABORT)
    return results


def assert_no_leaks(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert pool.num_free == pool.num_blocks
    assert not any(pool.ref_counts)
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not scheduler.kv.blocks


def prompts_for(seed: int, count: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


@pytest.mark.parametrize("budget", [1, 7, 16, 64, 8192])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_do_not_depend_on_the_schedule(budget, async_scheduling):
    prompts = prompts_for(1, 12)
    max_tokens = [random.Random(i).randrange(1, 40) for i in range(12)]
    scheduler = make_scheduler(num_blocks=400, budget=budget, async_scheduling=async_scheduling)
    results = run(scheduler, prompts, max_tokens, in_flight=2 if async_scheduling else 1)
    for handle, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        tokens, reason = results[handle]
        assert tokens == expected_output(prompt, mt)
        assert reason == (FinishReason.STOP if tokens[-1] == EOS else FinishReason.LENGTH)
    assert_no_leaks(scheduler)


def test_preemption_happens_and_outputs_survive():
    prompts = prompts_for(2, 10, max_len=40)
    max_tokens = [60] * 10
    scheduler = make_scheduler(num_blocks=40, block_size=4, budget=32)
    results = run(scheduler, prompts, max_tokens)
    assert scheduler.num_preemptions > 0
    for handle, prompt in enumerate(prompts):
        assert results[handle][0] == expected_output(prompt, 60)
    assert_no_leaks(scheduler)


def test_prefix_cache_hits_and_is_reused():
    system = list(range(100, 164))  # 64 shared tokens = 16 blocks of 4
    scheduler = make_scheduler(num_blocks=200, block_size=4)
    worker = FakeWorker()
    run(scheduler, [system + [7, 8, 9]], [4], worker=worker)
    hits_before = scheduler.kv.stats.hits
    run(scheduler, [system + [11, 12]], [4], worker=worker)
    assert scheduler.kv.stats.hits - hits_before == 64
    assert_no_leaks(scheduler)


def test_prefix_caching_off_never_hits():
    system = list(range(100, 164))
    scheduler = make_scheduler(num_blocks=200, block_size=4, caching=False)
    run(scheduler, [system + [1], system + [2]], [3, 3])
    assert scheduler.kv.stats.hits == 0
    assert_no_leaks(scheduler)


def test_request_that_can_never_fit_is_rejected():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(Request(0, list(range(10, 20)), SamplingParams(max_tokens=20), (EOS,), MAX_LEN))
    assert_no_leaks(scheduler)


def test_steady_decode_sends_no_new_requests():
    scheduler = make_scheduler(num_blocks=400, block_size=16)
    worker = FakeWorker()
    for h, prompt in enumerate(prompts_for(3, 4, max_len=8)):
        scheduler.add_request(Request(h, prompt, SamplingParams(max_tokens=40, ignore_eos=True), (EOS,), MAX_LEN))
    first = scheduler.schedule()
    scheduler.update(first, worker.execute(first))
    second = scheduler.schedule()
    assert len(first.new_requests) == 4 and not second.new_requests
    assert second.num_scheduled_tokens == [1, 1, 1, 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(24, 120), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 128), max_seqs=st.integers(1, 12), caching=st.booleans(),
       async_scheduling=st.booleans(), abort_prob=st.sampled_from([0.0, 0.05, 0.3]),
       arrive_every=st.integers(0, 5))
def test_no_leaks_property(seed, num_blocks, block_size, budget, max_seqs, caching, async_scheduling,
                           abort_prob, arrive_every):
    rng = random.Random(seed)
    count = rng.randrange(1, 40)
    capacity = num_blocks * block_size
    prompts, max_tokens = [], []
    for _ in range(count):
        length = rng.randrange(1, 48)
        prompt = [rng.randrange(10, 30) for _ in range(length)]  # small alphabet: shared prefixes
        mt = rng.randrange(1, 48)
        if -(-(length + mt) // block_size) > num_blocks:
            mt = max(1, capacity - length)
            if length + mt > capacity:
                continue
        prompts.append(prompt)
        max_tokens.append(mt)
    scheduler = make_scheduler(num_blocks, block_size, budget, max_seqs, caching, async_scheduling)
    results = run(scheduler, prompts, max_tokens, abort_prob=abort_prob, rng=rng,
                  in_flight=2 if async_scheduling else 1, arrive_every=arrive_every)
    for handle, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        tokens, reason = results[handle]
        expected = expected_output(prompt, mt)
        if reason == FinishReason.ABORT:
            assert tokens == expected[:len(tokens)]
        else:
            assert tokens == expected
    assert_no_leaks(scheduler)


def test_thousands_of_requests_with_aborts_and_preemptions_leave_nothing_behind():
    preemptions = aborts = hits = requests = 0
    for seed in range(150):
        rng = random.Random(seed)
        num_blocks, block_size = rng.randrange(24, 120), rng.choice([1, 2, 4, 16])
        batch = [[rng.randrange(10, 30) for _ in range(rng.randrange(1, 48))] for _ in range(30)]
        batch = [(p, rng.randrange(1, 48)) for p in batch]
        batch = [(p, m) for p, m in batch if -(-(len(p) + m) // block_size) <= num_blocks]
        async_scheduling = rng.random() < 0.5
        scheduler = make_scheduler(num_blocks, block_size, rng.randrange(1, 128), rng.randrange(1, 12),
                                   caching=rng.random() < 0.8, async_scheduling=async_scheduling)
        results = run(scheduler, [p for p, _ in batch], [m for _, m in batch], abort_prob=0.05, rng=rng,
                      in_flight=2 if async_scheduling else 1, arrive_every=rng.randrange(0, 4))
        for handle, (prompt, mt) in enumerate(batch):
            tokens, reason = results[handle]
            expected = expected_output(prompt, mt)
            assert tokens == (expected[:len(tokens)] if reason == FinishReason.ABORT else expected)
        assert_no_leaks(scheduler)
        requests += len(batch)
        preemptions += scheduler.num_preemptions
        aborts += sum(1 for _, reason in results.values() if reason == FinishReason.ABORT)
        hits += scheduler.kv.stats.hits
    assert requests > 3000 and preemptions > 100 and aborts > 100 and hits > 1000


def test_steady_state_messages_are_small():
    """256 running decodes, no new blocks: the step message is O(1) bytes, results ~4 bytes a request."""
    import msgspec
    scheduler = make_scheduler(num_blocks=4000, block_size=16, budget=8192, max_seqs=256)
    worker = FakeWorker()
    for h in range(256):
        scheduler.add_request(Request(h, [10 + h % 50] * 3, SamplingParams(max_tokens=12, ignore_eos=True),
                                      (EOS,), MAX_LEN))
    sizes = []
    for _ in range(6):
        so = scheduler.schedule()
        out = worker.execute(so)
        sizes.append((len(msgspec.msgpack.encode(so)), len(msgspec.msgpack.encode(out))))
        scheduler.update(so, out)
    # Steps 2..6 are steady decodes (prompt of 3 tokens: no new block until token 16).
    for step_bytes, result_bytes in sizes[1:]:
        assert step_bytes <= 64, sizes
        assert result_bytes <= 5 * 256, sizes
    assert sizes[0][0] > 256 * 10  # the first step carried every new request in full
