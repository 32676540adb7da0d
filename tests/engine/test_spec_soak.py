"""A soak of speculative decoding in one engine: thousands of short requests (greedy and seeded,
n-gram drafts), random aborts mid-flight and a KV pool small enough to preempt, then nothing
may be left: every request ended exactly once, every KV block free, the scheduler's running
table empty, the worker holding no request and its speculator no live slot.

10,000 requests take about 40 s on 2 CPU cores: the KV pool (48 blocks of 4 tokens) rather than
the model bounds the batch, so it preempts often and every step stays small."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.helpers.engine import worker_runner
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind

ENGINE = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0},
              num_gpu_blocks_override=48, max_num_seqs=32, block_size=4, max_model_len=64)
IN_FLIGHT = 48  # submitted and not ended: more than max_num_seqs, so some always wait
ABORT_PER_STEP = 0.3  # chance that a step is preceded by aborting one random in-flight request


@dataclass
class Tally:
    ended: Counter = field(default_factory=Counter)  # request id -> times it ended (finished or aborted)
    aborted: set[str] = field(default_factory=set)
    aborted_running: int = 0  # aborts that hit a request in the running batch (not waiting)
    output_tokens: int = 0
    steps: int = 0


def request(rng: np.random.Generator):
    """A short repetitive prompt (so n-gram lookup proposes) and a few tokens, greedy or seeded."""
    phrase = rng.integers(5, 200, int(rng.integers(2, 6))).tolist()
    prompt = {"prompt_token_ids": phrase * int(rng.integers(2, 5))}
    max_tokens = int(rng.integers(1, 9))
    if rng.random() < 0.5:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.8, top_k=40, seed=int(rng.integers(1 << 30)), max_tokens=max_tokens,
                                ignore_eos=bool(rng.random() < 0.8))
    return prompt, params


def drive(llm: LLM, num_requests: int, seed: int = 0) -> Tally:
    """Keep IN_FLIGHT requests going until `num_requests` have ended; abort some at random."""
    rng = np.random.default_rng(seed)
    frontend, client, scheduler = llm.frontend, llm.client, llm.engine.scheduler
    tally, live, submitted = Tally(), [], 0
    while submitted < num_requests or live:
        while submitted < num_requests and len(live) < IN_FLIGHT:
            prompt, params = request(rng)
            request_id = f"r{submitted}"
            frontend.submit(request_id, frontend.prepare(prompt, params).with_output_kind(RequestOutputKind.FINAL_ONLY))
            live.append(request_id)
            submitted += 1
        if live and rng.random() < ABORT_PER_STEP:
            victim = live.pop(int(rng.integers(len(live))))
            running, known = set(scheduler.table.handle[scheduler.table.order].tolist()), set(scheduler.requests)
            frontend.abort(victim)
            tally.aborted_running += len((known - set(scheduler.requests)) & running)
            tally.aborted.add(victim)
            tally.ended[victim] += 1
        processed = frontend.process(client.get_outputs())
        tally.steps += 1
        assert not processed.failures, processed.failures
        for out in processed.request_outputs:
            assert out.request_id not in tally.aborted, f"{out.request_id} came back after its abort"
            assert out.finished  # FINAL_ONLY
            tally.ended[out.request_id] += 1
            tally.output_tokens += len(out.outputs[0].token_ids)
            live.remove(out.request_id)
    client.drain()
    return tally


def settle(llm: LLM) -> None:
    """Run the (empty) steps that tell the worker which requests ended, so it can let them go."""
    engine = llm.engine
    while engine.scheduler.finished_to_send or engine.in_flight:
        engine.step()


def assert_nothing_left(llm: LLM, tally: Tally, num_requests: int) -> None:
    assert sorted(tally.ended) == sorted(f"r{i}" for i in range(num_requests)), "a request never ended"
    twice = [r for r, n in tally.ended.items() if n != 1]
    assert not twice, f"requests that ended more than once: {twice[:10]}"
    settle(llm)
    assert_engine_idle(llm)  # KV pool free, no request in the front-end, the scheduler or in flight
    kv = llm.kv_cache_stats()
    assert kv["num_free_blocks"] == kv["num_blocks"] == ENGINE["num_gpu_blocks_override"] and kv["num_requests"] == 0
    table = llm.engine.scheduler.table
    assert table.num_running == 0 and (table.handle == -1).all() and not any(table.requests), "running table not empty"
    runner = worker_runner(llm)
    assert runner.batch.slot_of == {} and (runner.batch.handle_of == -1).all(), runner.batch.slot_of
    assert runner.speculator.live_slots() == [], f"speculator slots still live: {runner.speculator.live_slots()}"


def soak(tiny_model_dir: str, num_requests: int) -> None:
    llm = tiny_llm(tiny_model_dir, **ENGINE)
    try:
        tally = drive(llm, num_requests)
        stats = llm.scheduler_stats()
        assert_nothing_left(llm, tally, num_requests)
        # Not vacuous: every path the soak is about was taken, many times.
        assert len(tally.aborted) > num_requests // 20 and tally.aborted_running > num_requests // 50, (
            len(tally.aborted), tally.aborted_running)
        assert stats["num_preemptions"] > num_requests // 50, stats
        assert stats["spec_num_drafts"] > num_requests // 2 and stats["spec_num_accepted_tokens"] > 0, stats
        assert tally.output_tokens > 2 * num_requests, tally.output_tokens
    finally:
        llm.shutdown()


def test_ten_thousand_requests_leave_nothing_behind(tiny_model_dir):
    soak(tiny_model_dir, 10_000)
