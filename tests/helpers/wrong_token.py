"""Test-only fault injection: one wrong greedy token, to prove that the comparisons can fail.

The runner's `sampler.sample` is wrapped (monkeypatch, no hook in tokenmill): at the first sampler call
from `at_call` on where row 0's top-2 logits differ by at least `min_gap`, those two logits are
swapped, so that row samples the runner-up, a token that is wrong by a clear margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.helpers.engine import worker_runner


@dataclass
class WrongToken:
    at_call: int
    min_gap: float
    calls: int = 0
    gap: float | None = None  # the swapped logits' gap, once injected


def inject_wrong_token(monkeypatch, llm, at_call: int = 4, min_gap: float = 0.1) -> WrongToken:
    runner = worker_runner(llm)
    real_sample = runner.sampler.sample
    fault = WrongToken(at_call, min_gap)

    def sample(logits, slots, **kwargs):
        fault.calls += 1
        if fault.gap is None and fault.calls >= at_call:
            top2 = logits[0].float().topk(2)
            gap = float(top2.values[0] - top2.values[1])
            if gap >= min_gap:
                logits = logits.clone()
                logits[0, top2.indices] = logits[0, top2.indices.flip(0)]
                fault.gap = gap
        return real_sample(logits, slots, **kwargs)

    monkeypatch.setattr(runner.sampler, "sample", sample)
    return fault
