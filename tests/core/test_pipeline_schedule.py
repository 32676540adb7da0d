"""The scheduler with two pipeline stages, without a model: several micro-batches in flight
never schedule a token the scheduler does not know (no decode while a request's token is in
flight; further prefill chunks are fine), each row's first input token travels with the step,
micro-batches split the work evenly by tokens, and outputs, aborts and preemptions behave as
with one batch in flight (`fake_worker.py`: tokens as a fixed function of prompt and position)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.core.fake_worker import EOS, expected_output
from tests.core.test_scheduler import assert_no_leaks, prompts_for, run
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import FinishReason, ModelRunnerOutput
from tokenmill.sampling_params import SamplingParams


def pp_scheduler(num_blocks: int, budget: int = 64, block_size: int = 4, microbatches: int = 0,
                 device_tokens: bool = False) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, pp_microbatches=microbatches,
                                          pp_device_tokens=device_tokens),
                          CacheConfig(block_size=block_size), num_blocks, pipeline_stages=2)
    schedule = scheduler.schedule

    def checked_schedule():
        """Every row computes only tokens the scheduler knows (with device tokens: at most one
        more, whose input is -1), and its first input travels."""
        so = schedule()
        if so is not None and len(so.row_slots):
            t = scheduler.table
            ahead = t.num_tokens[so.row_slots] + (1 if device_tokens else 0)
            assert (t.num_computed[so.row_slots] <= ahead).all(), "a placeholder was scheduled"
            first = t.num_computed[so.row_slots] - so.batch_counts
            sent = np.frombuffer(so.pp_input_tokens, "<i4")
            known = first < t.num_tokens[so.row_slots]
            assert sent[known].tolist() == t.tokens[so.row_slots[known], first[known]].tolist()
            assert (sent[~known] == -1).all() and (device_tokens or known.all())
        return so

    scheduler.schedule = checked_schedule
    return scheduler


def test_micro_batches_split_the_work_by_tokens() -> None:
    scheduler = pp_scheduler(num_blocks=200, budget=64)
    for handle in range(8):
        scheduler.add_request(Request(handle, [10 + handle] * 10, SamplingParams(max_tokens=5), (EOS,), 256))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first.total_num_scheduled_tokens == second.total_num_scheduled_tokens == 40  # 80 tokens, 2 stages
    assert scheduler.schedule() is None  # every request's token is in flight: nothing to decode
    out = ModelRunnerOutput.from_rows(first.step_id, [[7]] * 4)
    scheduler.update(first, out)
    decode = scheduler.schedule()  # the first micro-batch's requests decode while the second is in flight
    assert sorted(decode.scheduled_handles) == sorted(first.scheduled_handles)
    assert decode.num_scheduled_tokens == [1] * 4 and np.frombuffer(decode.pp_input_tokens, "<i4").tolist() == [7] * 4


def test_more_micro_batches_than_stages_split_the_work_finer() -> None:
    # pp_microbatches=4 on two stages: the 8 prompts' 80 tokens go as four batches of 20.
    scheduler = pp_scheduler(num_blocks=200, budget=64, microbatches=4)
    for handle in range(8):
        scheduler.add_request(Request(handle, [10 + handle] * 10, SamplingParams(max_tokens=5), (EOS,), 256))
    batches = [scheduler.schedule() for _ in range(4)]
    assert [b.total_num_scheduled_tokens for b in batches] == [20] * 4
    assert scheduler.schedule() is None


def test_a_long_prompt_chunks_across_micro_batches() -> None:
    scheduler = pp_scheduler(num_blocks=200, budget=64)
    scheduler.add_request(Request(0, list(range(10, 110)), SamplingParams(max_tokens=3), (EOS,), 256))
    first, second = scheduler.schedule(), scheduler.schedule()  # its next chunk while the first is in flight
    assert first.scheduled_handles == second.scheduled_handles == [0]
    assert first.total_num_scheduled_tokens == 50 and second.total_num_scheduled_tokens == 50


@pytest.mark.parametrize("budget,num_blocks", [(7, 400), (64, 400), (64, 40)],
                         ids=["small-budget", "roomy", "preempting"])
@pytest.mark.parametrize("in_flight", [2, 3])
def test_outputs_aborts_and_preemptions_as_with_one_batch(budget, num_blocks, in_flight) -> None:
    prompts = prompts_for(3, 12)
    max_tokens = [random.Random(i).randrange(1, 40) for i in range(12)]
    scheduler = pp_scheduler(num_blocks=num_blocks, budget=budget)
    results = run(scheduler, prompts, max_tokens, in_flight=in_flight, abort_prob=0.03, rng=random.Random(5))
    for handle, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        tokens, reason = results[handle]
        expected = expected_output(prompt, mt)
        if reason == FinishReason.ABORT:
            assert tokens == expected[:len(tokens)]
        else:
            assert tokens == expected
    if num_blocks == 40:
        assert scheduler.num_preemptions > 0
    assert scheduler.in_flight_tokens == 0
    assert_no_leaks(scheduler)


def test_device_tokens_run_a_micro_batch_on_its_tokens_in_flight() -> None:
    """With device tokens, the first micro-batch's rows go again while both are in flight (their
    inputs -1: the first stage takes them from the last), then the second's once the first is
    applied; a row never carries two placeholders, and the other micro-batch waits its turn."""
    scheduler = pp_scheduler(num_blocks=200, budget=64, device_tokens=True)
    for handle in range(8):
        scheduler.add_request(Request(handle, [10 + handle] * 10, SamplingParams(max_tokens=5), (EOS,), 256))
    first, second = scheduler.schedule(), scheduler.schedule()
    again = scheduler.schedule()  # the oldest step's rows, on their tokens in flight
    assert sorted(again.scheduled_handles) == sorted(first.scheduled_handles)
    assert np.frombuffer(again.pp_input_tokens, "<i4").tolist() == [-1] * 4 and again.pp_tokens_upto == first.step_id
    assert scheduler.schedule() is None  # the second's rows wait for the first step to be applied
    scheduler.update(first, ModelRunnerOutput.from_rows(first.step_id, [[7]] * 4))
    turn = scheduler.schedule()
    assert sorted(turn.scheduled_handles) == sorted(second.scheduled_handles)
    assert turn.pp_tokens_upto == second.step_id and np.frombuffer(turn.pp_input_tokens, "<i4").tolist() == [-1] * 4


@pytest.mark.parametrize("budget,num_blocks", [(7, 400), (64, 400), (64, 40)],
                         ids=["small-budget", "roomy", "preempting"])
def test_device_tokens_outputs_aborts_and_preemptions(budget, num_blocks) -> None:
    prompts = prompts_for(3, 12)
    max_tokens = [random.Random(i).randrange(1, 40) for i in range(12)]
    scheduler = pp_scheduler(num_blocks=num_blocks, budget=budget, device_tokens=True)
    results = run(scheduler, prompts, max_tokens, in_flight=3, abort_prob=0.03, rng=random.Random(5))
    for handle, (prompt, mt) in enumerate(zip(prompts, max_tokens)):
        tokens, reason = results[handle]
        expected = expected_output(prompt, mt)
        assert tokens == (expected[:len(tokens)] if reason == FinishReason.ABORT else expected)
    assert scheduler.in_flight_tokens == 0 and not scheduler._in_flight_steps
    assert_no_leaks(scheduler)
