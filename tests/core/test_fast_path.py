"""The vectorised scheduler against the slow reference (`reference_scheduler.py`, the logic
before the fast path): on random workloads, with preemptions, aborts, prefix hits, chunked
prefills, stop tokens, min_tokens, logprobs and async scheduling, every step message must be
byte-identical and every request must get the same tokens, finish reason and cache report."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.fake_worker import EOS, FakeWorker
from tests.core.reference_scheduler import ReferenceScheduler, RefRequest
from tests.core.test_scheduler import MAX_LEN, assert_no_leaks, make_scheduler
from tests.core.workloads import Workload, contention_workload, mixed_workload
from tokenmill.core.request import Request
from tokenmill.core.running_plan import RunningPlanner
from tokenmill.protocol import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams


def news(outputs: list[EngineCoreOutput]) -> dict[int, tuple]:
    """Outputs by handle, without the prefix-cache report (compared separately: the reference
    repeats it in every output, the fast path sends it once)."""
    return {o.handle: (list(o.new_token_ids), o.finish_reason, o.stop_token_id, msgspec.msgpack.encode(o.logprobs),
                       msgspec.msgpack.encode(o.prompt_logprobs)) for o in outputs}


def run_side_by_side(workload: Workload, seed: int, abort_prob: float = 0.05) -> dict[str, int]:
    """Drive both schedulers through the same workload; assert they agree at every step."""
    config, requests = workload
    rng = random.Random(seed + 1)
    fast = make_scheduler(**config)
    ref = ReferenceScheduler(config["max_seqs"], config["budget"], config["block_size"], config["caching"],
                             config["num_blocks"])
    fast_worker, ref_worker = FakeWorker(), FakeWorker()
    in_flight = 2 if config["async_scheduling"] else 1
    arrive_every = rng.randrange(0, 4)
    pending = list(enumerate(requests))
    queue = []
    cached_reports: list[dict[int, int]] = [{}, {}]
    prompt_rows: dict[int, int] = {}  # handle -> prompt-logprob rows heard
    aborted: set[int] = set()
    steps = 0

    def admit(count: int) -> None:
        for _ in range(count):
            if pending:
                handle, (prompt, params, eos) = pending.pop(0)
                fast.add_request(Request(handle, prompt, params, eos, MAX_LEN))
                ref.add_request(RefRequest(handle, prompt, params, eos, MAX_LEN))

    admit(len(pending) if not arrive_every else 1)
    while ref.requests or queue or pending:
        steps += 1
        assert steps < 20000, "no progress"
        if arrive_every and steps % arrive_every == 0:
            admit(1)
        while len(queue) < in_flight:
            so_fast, so_ref = fast.schedule(), ref.schedule()
            assert (so_fast is None) == (so_ref is None), f"step {steps}: only one side has a step"
            if so_fast is None:
                break
            assert msgspec.msgpack.encode(so_fast) == msgspec.msgpack.encode(so_ref), f"step {so_ref.step_id}"
            queue.append((so_fast, fast_worker.execute(so_fast), so_ref, ref_worker.execute(so_ref)))
        if not queue:
            admit(1)
            continue
        so_fast, out_fast, so_ref, out_ref = queue.pop(0)
        assert msgspec.msgpack.encode(out_fast) == msgspec.msgpack.encode(out_ref)
        fast_outputs = fast.update(so_fast, out_fast).all_outputs()
        ref_outputs = ref.update(so_ref, out_ref)
        assert news(fast_outputs) == news(ref_outputs), f"step {so_ref.step_id}"
        for o in fast_outputs:
            if o.prompt_logprobs is not None:
                prompt_rows[o.handle] = prompt_rows.get(o.handle, 0) + o.prompt_logprobs.rows
        for reports, outputs in zip(cached_reports, (fast_outputs, ref_outputs)):
            for o in outputs:  # the front-end keeps the largest report
                reports[o.handle] = max(reports.get(o.handle, 0), o.num_cached_tokens)
        assert cached_reports[0] == cached_reports[1]
        assert sorted(fast.requests) == sorted(ref.requests)
        assert fast.num_preemptions == ref.num_preemptions
        assert fast.kv.pool.num_free == ref.kv.pool.num_free
        fast_worker.check_mirrors(fast, fast.block_size)
        if abort_prob and ref.requests and rng.random() < abort_prob:
            victim = rng.choice(sorted(ref.requests))
            fast.abort([victim])
            ref.abort([victim])
            aborted.add(victim)
    assert_no_leaks(fast)
    # Prompt logprobs: one row per prompt position after the first, preempted or not.
    for handle, (prompt, params, _) in enumerate(requests):
        if params.prompt_logprobs is not None and handle not in aborted:
            assert prompt_rows.get(handle, 0) == len(prompt) - 1, f"request {handle}: {prompt_rows.get(handle)} rows"
    assert (fast.kv.stats.queries, fast.kv.stats.hits) == (ref.kv.queries, ref.kv.hits)
    return {"steps": steps, "preemptions": ref.num_preemptions, "hits": ref.kv.hits,
            "requests": len(requests)}


def test_fast_path_matches_reference():
    totals = {"steps": 0, "preemptions": 0, "hits": 0, "requests": 0}
    for seed in range(200):
        for key, value in run_side_by_side(mixed_workload(seed), seed).items():
            totals[key] += value
    assert totals["requests"] > 2000 and totals["preemptions"] > 100 and totals["hits"] > 1000, totals


def test_fast_path_matches_reference_under_prefix_cache_contention():
    """Bulk block growth does every allocation before every registration: only safe when no
    hash it registers is one its allocations evict. Without that check, seeds 99, 1693, 2483
    and 4172 diverge (a block registered that the reference leaves uncached)."""
    for seed in [99, 1693, 2483, 4172, *range(300)]:
        run_side_by_side(contention_workload(seed), seed, abort_prob=0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(1000, 10**6), abort_prob=st.sampled_from([0.0, 0.05, 0.3]))
def test_fast_path_matches_reference_property(seed, abort_prob):
    run_side_by_side(mixed_workload(seed), seed, abort_prob)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_decode_visits_no_row(async_scheduling, monkeypatch):
    """256 decoding requests, no new block due: no row takes the per-row paths."""
    scheduler = make_scheduler(num_blocks=4000, block_size=64, budget=8192, max_seqs=256,
                               async_scheduling=async_scheduling)
    worker = FakeWorker()
    for h in range(256):
        scheduler.add_request(Request(h, [10 + h % 50] * 3, SamplingParams(max_tokens=40, ignore_eos=True),
                                      (EOS,), MAX_LEN))
    queue = []
    for _ in range(3):  # prefill, then decodes
        so = scheduler.schedule()
        queue.append((so, worker.execute(so)))
        if len(queue) > async_scheduling:
            scheduler.update(*queue.pop(0))
    visited = []
    for name in ("_serve_in_bulk", "_serve_one_by_one", "_plan_in_order"):
        monkeypatch.setattr(RunningPlanner, name, lambda *args: visited.append(args))
    monkeypatch.setattr("tokenmill.core.step_update._apply_row", lambda *args: visited.append(args))
    for _ in range(20):
        so = scheduler.schedule()
        assert so.batch is None and not so.new_requests and so.cached_requests is None
        queue.append((so, worker.execute(so)))
        outputs = scheduler.update(*queue.pop(0))
        assert not outputs.outputs and len(outputs.token_ids) == 4 * 256
    assert not visited
