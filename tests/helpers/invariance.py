"""The schedule-invariance rule: greedy tokens must not depend on how the work was scheduled.

A run is compared with a reference run of the same engine code; both ask for `logprobs=2`, so
each reference row holds the chosen token and the runner-up. A divergence is accepted only where
the reference's top-2 logprobs are within NEAR_TIE (float summation order may flip them); the
rest of that sequence is then not compared.
"""

from __future__ import annotations

from tokenmill import SamplingParams

NEAR_TIE = 1e-4


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def top2_gap(row: dict) -> float:
    """The top-1 minus top-2 logprob of one position's logprobs (token id -> Logprob)."""
    top = sorted((lp.logprob for lp in row.values()), reverse=True)
    if len(top) < 2:
        raise AssertionError(f"the reference has no runner-up ({len(top)} entries): ask for logprobs=2")
    return top[0] - top[1]


def assert_same_greedy(reference, outputs, label: str, new_tokens: int) -> None:
    """`reference` and `outputs`: RequestOutputs of the same prompts, greedy with `greedy_params`."""
    assert len(reference) == len(outputs)
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = ref.outputs[0], out.outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == new_tokens, f"{label}: prompt {i}"
        for pos, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                gap = top2_gap(ref.logprobs[pos])
                assert gap < NEAR_TIE, (f"{label}: prompt {i} differs at token {pos} (gap {gap:.2e})\n"
                                        f"ref {ref.token_ids}\ngot {out.token_ids}")
                break
