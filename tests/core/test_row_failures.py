"""A row that fails alone in the worker ends only its request (FinishReason.ERROR, the failure
named, its token never shown); every other request's outputs are unchanged, and nothing leaks,
with async scheduling and preemptions in play."""

from __future__ import annotations

import pytest

from tests.core.fake_worker import FakeWorker, expected_output
from tests.core.test_scheduler import assert_no_leaks, make_scheduler, prompts_for, run
from tokenmill.core.request import Request
from tokenmill.protocol import FinishReason, ModelRunnerOutput, RowFailure, SchedulerOutput, pack_ids
from tokenmill.sampling_params import SamplingParams


class FailingWorker(FakeWorker):
    """Reports the row of each victim whose `fail_at`-th output token it samples as failed."""

    def __init__(self, victims: dict[int, tuple[int, RowFailure]]) -> None:
        super().__init__()
        self.victims = victims  # handle -> (output position, why)
        self.failed: list[int] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        rows, kinds = [], []
        counts = out.row_counts(len(so.scheduled_handles))
        for row, handle in enumerate(so.scheduled_handles):
            victim = self.victims.get(handle)
            if victim is None or counts[row] != 1:
                continue
            state = self.states[handle]
            if len(state["tokens"]) - state["num_prompt"] - 1 == victim[0]:  # the token just sampled
                rows.append(row)
                kinds.append(int(victim[1]))
                self.failed.append(handle)
        if rows:
            out.failed_rows, out.failures = pack_ids(rows), pack_ids(kinds)
        return out


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [400, 40])  # 40: preemptions
def test_failed_rows_end_only_their_requests(async_scheduling: bool, num_blocks: int) -> None:
    prompts = prompts_for(3, 10, max_len=40)
    max_tokens = [50] * 10
    victims = {2: (5, RowFailure.NON_FINITE_LOGITS), 6: (0, RowFailure.SAMPLING_ERROR),
               7: (30, RowFailure.NON_FINITE_LOGITS)}
    for handle, (at, _) in victims.items():
        assert len(expected_output(prompts[handle], 50)) > at, "the victim would finish before failing"
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, budget=32, async_scheduling=async_scheduling)
    worker = FailingWorker(victims)
    results = run(scheduler, prompts, max_tokens, in_flight=2 if async_scheduling else 1, worker=worker)
    assert sorted(worker.failed) == sorted(victims)
    for handle, prompt in enumerate(prompts):
        tokens, reason = results[handle]
        expected = expected_output(prompt, 50)
        if handle in victims:
            assert reason == FinishReason.ERROR
            assert tokens == expected[:victims[handle][0]]  # the failed row's token is never shown
        else:
            assert tokens == expected and reason != FinishReason.ERROR
    if num_blocks == 40:
        assert scheduler.num_preemptions > 0
    assert_no_leaks(scheduler)


def test_failure_output_names_the_failure_and_leaves_the_packed_columns() -> None:
    scheduler = make_scheduler(num_blocks=100)
    worker = FailingWorker({1: (2, RowFailure.SAMPLING_ERROR)})
    for handle in range(3):
        scheduler.add_request(Request(handle, [20 + handle, 21, 22], SamplingParams(max_tokens=10, ignore_eos=True),
                                      (), 256))
    for _ in range(10):
        so = scheduler.schedule()
        outputs = scheduler.update(so, worker.execute(so))
        if worker.failed:
            break
    handles, _ = outputs.one_token_rows()
    assert 1 not in handles.tolist()
    (failed,) = [o for o in outputs.outputs if o.handle == 1]
    assert failed.finish_reason == FinishReason.ERROR and failed.failure == RowFailure.SAMPLING_ERROR
    assert failed.new_token_ids == [] and sorted(handles.tolist()) == [0, 2]
    assert 1 not in scheduler.requests and 1 in scheduler.finished_to_send
