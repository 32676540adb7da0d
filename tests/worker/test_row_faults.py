"""The worker's row screen and sampling retry on crafted inputs: only the faulty rows are marked,
the other rows' samples are what the batch would have given them, and the host side maps the
sentinels to batch rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.layers.sampling import Sampler, SamplerOutput, SamplingState
from tokenmill.layers.sampling.slot_table import IntCol
from tokenmill.layers.sampling.spec_layout import flat_to_padded
from tokenmill.layers.sampling.spec_verify import verify_drafts
from tokenmill.protocol import RowFailure
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.fault_injection import FaultInjector, FaultPlan, Trigger
from tokenmill.worker.row_faults import (PLACEHOLDER_TOKEN, VerifyBatch, mark_failed, mark_failed_counts, sample_rows,
                                         screen_logits, split_failures, verify_rows)

V = 50


def test_screen_flags_and_zeroes_only_non_finite_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 5
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, V - 1] = float("-inf")
    before = logits.clone()
    bad = screen_logits(logits)
    assert bad.tolist() == [False, True, False, True, True, False]
    assert torch.equal(logits[[0, 2, 5]], before[[0, 2, 5]])  # untouched, bit for bit
    assert torch.equal(logits[[1, 3, 4]], torch.zeros(3, V))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_screen_does_not_flag_large_finite_half_logits(dtype) -> None:
    logits = torch.full((2, 4096), 60000.0 if dtype == torch.float16 else 1e30, dtype=dtype)
    assert not screen_logits(logits).any()  # the sum is taken in float32


def _sampler(params: list[SamplingParams]) -> Sampler:
    state = SamplingState(8, V, (2,), "cpu")
    for slot, p in enumerate(params):
        state.add(slot, p, [5, 6, 7])
    return Sampler(state)


def test_sampling_error_fails_only_its_row() -> None:
    """A sampler that raises whenever slot 2 is sampled: row 1 (slot 2) fails; the others get
    what a batch without it gives them; the retries record nothing."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([0, 2, 3])
    reference = _sampler(params).sample(logits.clone(), torch.tensor([0, 8, 3]))  # slot 8: scratch
    sampler = _sampler(params)
    calls = []

    def sample(lg, sl, *, record=True) -> SamplerOutput:
        calls.append((sl.tolist(), record))
        if 2 in sl.tolist():
            raise RuntimeError("boom")
        return sampler.sample(lg, sl, record=record)

    out, failed = sample_rows(sample, logits.clone(), slots, scratch_slot=8)
    assert failed == [1]
    assert out.sampled[[0, 2]].tolist() == reference.sampled[[0, 2]].tolist()
    assert calls == [([0, 2, 3], True), ([0], False), ([2], False), ([3], False), ([0, 8, 3], True)]
    marked = mark_failed(out, None, failed).sampled
    assert marked.tolist() == [out.sampled[0].item(), -int(RowFailure.SAMPLING_ERROR), out.sampled[2].item()]


def test_no_failure_is_one_call_and_unmarked() -> None:
    sampler = _sampler([SamplingParams(temperature=0.0)] * 2)
    logits = torch.randn(2, V)
    out, failed = sample_rows(sampler.sample, logits, torch.tensor([0, 1]), scratch_slot=8)
    assert failed == [] and torch.equal(out.sampled, logits.argmax(-1))
    assert mark_failed(out, torch.zeros(2, dtype=torch.bool), []).sampled.tolist() == out.sampled.tolist()


def test_non_finite_row_through_the_real_sampler() -> None:
    """Screened rows sample without error (they are zeros); the others are unchanged."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=5, presence_penalty=0.5, logprobs=2)] * 3
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    clean = _sampler(params).sample(logits.clone(), torch.tensor([0, 1, 2]))
    logits[1] = float("nan")
    bad = screen_logits(logits)
    out, failed = sample_rows(_sampler(params).sample, logits, torch.tensor([0, 1, 2]), scratch_slot=8)
    assert failed == []
    marked = mark_failed(out, bad, failed).sampled.tolist()
    assert marked[1] == -int(RowFailure.NON_FINITE_LOGITS)
    assert [marked[0], marked[2]] == clean.sampled[[0, 2]].tolist()


def test_split_failures_maps_sampling_rows_to_batch_rows() -> None:
    tokens = np.array([11, -int(RowFailure.NON_FINITE_LOGITS), 12, -int(RowFailure.SAMPLING_ERROR)])
    rows = np.array([0, 2, 3, 5])  # batch rows of the sampling rows (rows 1 and 4 were prompt chunks)
    clean, failed_rows, kinds = split_failures(tokens, rows)
    assert clean.tolist() == [11, 0, 12, 0]
    assert np.frombuffer(failed_rows, "<i4").tolist() == [2, 5]
    assert [RowFailure(k) for k in np.frombuffer(kinds, "<i4")] == [RowFailure.NON_FINITE_LOGITS,
                                                                    RowFailure.SAMPLING_ERROR]
    same, none, _ = split_failures(np.array([1, 2]), np.array([0, 1]))
    assert none == b"" and same.tolist() == [1, 2]


def test_speculative_rows_are_failed_by_any_of_their_positions() -> None:
    """Positions 0-1 belong to row 0, 2-4 to row 1, 5 to row 2; position 3 is non-finite."""
    row_of = torch.tensor([0, 0, 1, 1, 1, 2])
    non_finite = torch.tensor([False, False, False, True, False, False])
    marked = mark_failed_counts(torch.tensor([2, 3, 1]), non_finite, row_of)
    assert marked.tolist() == [2, -int(RowFailure.NON_FINITE_LOGITS), 1]
    counts, failed_rows, _ = split_failures(marked.numpy(), np.array([0, 1, 2]), healthy=1)
    assert counts.tolist() == [2, 1, 1] and np.frombuffer(failed_rows, "<i4").tolist() == [1]


K = 3


def _verify_batch(slots: list[int], drafts: list[int], logits: torch.Tensor) -> VerifyBatch:
    per_row = np.array(drafts) + 1
    offsets = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    return VerifyBatch(logits, torch.as_tensor(np.repeat(slots, per_row)), torch.as_tensor(offsets),
                       torch.tensor(slots), torch.tensor(drafts), np.array(drafts), K)


def _verifier(sampler: Sampler, proposals: torch.Tensor, calls: list, bad_slot: int):
    """One-hot drafts verified as the worker does; raises whenever `bad_slot` is among the rows."""
    def verify(b: VerifyBatch):
        calls.append(b.slots.tolist())
        if bad_slot in b.slots.tolist():
            raise RuntimeError("boom")
        out = sampler.sample(b.logits, b.position_slots, offsets=b.offsets, record=False)
        grid = flat_to_padded(out.sampled, b.num_drafts, K, -1)
        return (*verify_drafts(grid, proposals[b.slots], b.num_drafts), None)
    return verify


def test_verification_error_fails_only_its_row() -> None:
    """Rows (slots 0, 2, 3, 1) verify 3, 2, 0 and 3 drafts; verifying slot 2 raises. Row 1 emits
    the placeholder once; the others emit what a batch without row 1 gives them (seeded and
    greedy rows: exactly), and no call recorded anything in the sampler."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0)]
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(1))
    proposals = logits.argmax(-1)[torch.tensor([[0, 1, 2], [4, 5, 0], [0, 0, 0], [9, 10, 8]])]  # some right, some not
    slots, drafts = [0, 2, 3, 1], [3, 2, 0, 3]
    sampler = _sampler(params)
    calls: list = []
    (emitted, num_emitted, logprobs), failed = verify_rows(_verifier(sampler, proposals, calls, bad_slot=2),
                                                           _verify_batch(slots, drafts, logits))
    assert failed == [1] and logprobs is None
    assert calls == [[0, 2, 3, 1], [0], [2], [3], [1], [0, 3, 1]]
    without = _verify_batch([0, 3, 1], [3, 0, 3], logits[[0, 1, 2, 3, 7, 8, 9, 10, 11]])
    (want, want_num, _), none = verify_rows(_verifier(_sampler(params), proposals, [], bad_slot=-1), without)
    assert none == []
    assert emitted[[0, 2, 3]].tolist() == want.tolist() and num_emitted[[0, 2, 3]].tolist() == want_num.tolist()
    assert emitted[1].tolist() == [PLACEHOLDER_TOKEN, -1, -1, -1] and num_emitted[1] == 1
    assert want_num.tolist() != [1, 1, 1], "no draft was accepted: the test verifies nothing"
    assert sampler.state.table.column(IntCol.NUM_OUTPUTS, torch.arange(4)).tolist() == [0] * 4  # nothing recorded
    marked = mark_failed_counts(num_emitted, torch.zeros(12, dtype=torch.bool),
                                torch.as_tensor(np.repeat(np.arange(4), np.array(drafts) + 1)), failed)
    assert marked.tolist() == [num_emitted[0], -int(RowFailure.SAMPLING_ERROR), num_emitted[2], num_emitted[3]]


def test_verification_error_of_every_row_leaves_placeholders() -> None:
    logits = torch.randn(4, V)
    calls: list = []
    verify = _verifier(_sampler([SamplingParams(temperature=0.0)] * 2), torch.zeros(8, K, dtype=torch.int64),
                       calls, bad_slot=1)
    (emitted, num_emitted, _), failed = verify_rows(verify, _verify_batch([1], [3], logits))
    assert failed == [0] and emitted.tolist() == [[PLACEHOLDER_TOKEN, -1, -1, -1]] and num_emitted.tolist() == [1]
    assert calls == [[1], [1]]


def test_a_verification_error_no_row_has_alone_fails_the_step() -> None:
    """Rows that pass alone but not together: the step's own failure, raised."""
    def verify(b: VerifyBatch):
        if len(b.drafts) > 1:
            raise RuntimeError("batch-level failure")
        return torch.zeros(1, K + 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), None
    with pytest.raises(RuntimeError, match="batch-level"):
        verify_rows(verify, _verify_batch([0, 1], [1, 2], torch.randn(5, V)))


def test_fault_injection_is_off_without_its_variable() -> None:
    assert FaultInjector.from_env({}) is None
    assert FaultInjector.from_env({"TOKENMILL_TEST_FAULTS": ""}) is None
    plan = FaultInjector.from_env({"TOKENMILL_TEST_FAULTS": '{"nan_logits": {"marker_token": 7, "after": 2}}'}).plan
    assert plan == FaultPlan(nan_logits=Trigger(7, 2))
    with pytest.raises(Exception):  # a misspelt plan fails loudly instead of injecting nothing
        FaultInjector.from_env({"TOKENMILL_TEST_FAULTS": '{"nan_logit": {"marker_token": 7}}'})
