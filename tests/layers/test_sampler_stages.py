"""What a step dispatches: only the stages some active slot needs, and nothing that waits on the device.

Counts ATen ops with a TorchDispatchMode (no timing). On CUDA the step also runs under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any host sync.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.helpers.sampling import DEVICES, SYNCING_OPS, Harness, OpLog, no_host_sync
from tokenmill.sampling_params import SamplingParams


def step_ops(h: Harness, num_rows: int, slots: list[int]) -> Counter[str]:
    logits = torch.randn(num_rows, h.vocab_size, generator=torch.Generator().manual_seed(0)).to(h.device)
    index = h.slots(slots)
    h.sampler.sample(logits, index, record=False)  # flush the queued writes first
    with no_host_sync(h.device), OpLog() as log:
        out = h.sampler.sample(logits, index, record=False)
        h.sampler.record(index, out.sampled)
    return log.ops


@pytest.mark.parametrize("device", DEVICES)
def test_plain_greedy_step_is_one_argmax(device) -> None:
    h = Harness(device, 100)
    h.add(0, SamplingParams(temperature=0))
    h.add(1, SamplingParams(temperature=1e-6, top_k=3, seed=1))
    h.add(2, SamplingParams(**ALL))
    h.remove(2)  # what it needed is no longer paid for
    ops = step_ops(h, 4, [0, 1, h.scratch, 0])
    if device == "cpu":  # host float32 logits: numpy's argmax (`row_argmax`), its result wrapped
        assert set(ops) <= {"lift_fresh", "detach", "resolve_conj", "resolve_neg", "to"}, ops  # no compute op
    else:
        assert ops == Counter({"argmax": 1})


ALL = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, logit_bias={1: 1.0}, min_tokens=5,
           repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, logprobs=2)

# (params of the one random slot beside a greedy one, ops that must appear, ops that must not)
STAGES = [
    (dict(), {"exponential_", "softmax"},
     {"sort", "topk", "amax", "bitwise_xor_", "scatter_add_", "log_softmax", "index_add_", "cumsum_"}),
    (dict(top_k=5), {"topk"}, {"sort", "cumsum_", "amax"}),
    (dict(top_p=0.9), {"sort", "cumsum_"}, {"topk"}),
    (dict(min_p=0.1), {"amax"}, {"sort", "topk"}),
    (dict(seed=3), {"bitwise_xor_"}, {"exponential_"}),
    (dict(logit_bias={2: 1.0}), {"scatter_add_"}, {"index_add_", "bitwise_xor_"}),
    (dict(frequency_penalty=0.5), {"index_add_"}, {"scatter_add_", "__or__", "sort"}),
    (dict(logprobs=3), {"log_softmax", "topk"}, {"sort", "index_add_"}),
    (ALL, {"sort", "bitwise_xor_", "scatter_add_", "index_add_", "log_softmax"}, set()),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params, present, absent", STAGES, ids=lambda x: ",".join(x) if isinstance(x, dict) else None)
def test_a_stage_runs_only_when_an_active_slot_uses_it(device, params, present, absent) -> None:
    h = Harness(device, 100, eos=[0])
    h.add(0, SamplingParams(temperature=0))
    h.add(1, SamplingParams(**params), prompt=[4, 5], outputs=[6])
    ops = step_ops(h, 5, [0, 1, h.scratch, 1, 0])
    assert present <= set(ops), f"missing {present - set(ops)}"
    assert not absent & set(ops), f"unexpected {absent & set(ops)}"
    assert not SYNCING_OPS & set(ops), f"host syncs: {SYNCING_OPS & set(ops)}"
