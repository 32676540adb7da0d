"""The schedule-invariance rule: greedy tokens must not depend on how the work was scheduled.

A run is compared with a reference run of the same engine code; the reference asks for
`logprobs=2`, so each reference row holds the chosen token and the runner-up. A divergence is
accepted only where the reference's top-2 logprobs are within NEAR_TIE (float summation order may
flip them; the rest of that sequence is then not compared), and, as in the HF rule
(`hf_reference.py`), at most one such divergence per PROMPTS_PER_NEAR_TIE prompts, rounded up.
Every prompt is checked: the failure lists every divergence, not only the first.
"""

from __future__ import annotations

from tests.helpers.hf_reference import max_near_ties
from tokenmill import SamplingParams

NEAR_TIE = 1e-4  # tighter than HF's 1e-3: both sides run tokenmill's own kernels


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def top2_gap(row: dict) -> float:
    """The top-1 minus top-2 logprob of one position's logprobs (token id -> Logprob)."""
    top = sorted((lp.logprob for lp in row.values()), reverse=True)
    if len(top) < 2:
        raise AssertionError(f"the reference has no runner-up ({len(top)} entries): ask for logprobs=2")
    return top[0] - top[1]


def first_divergence(ref, out) -> int | None:
    """The first position where two CompletionOutputs' tokens differ, or None."""
    return next((pos for pos, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)


def assert_same_greedy(reference, outputs, label: str, new_tokens: int) -> list[str]:
    """`reference` and `outputs`: RequestOutputs of the same prompts, the reference greedy with
    `greedy_params` (the outputs need no logprobs). Returns the accepted near-tie notes."""
    assert len(reference) == len(outputs), f"{label}: {len(outputs)} outputs for {len(reference)} prompts"
    near_ties: list[str] = []
    errors: list[str] = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = ref.outputs[0], out.outputs[0]
        if out.finish_reason != "length" or len(out.token_ids) != new_tokens:
            errors.append(f"prompt {i}: {len(out.token_ids)} tokens, finish {out.finish_reason!r}")
            continue
        pos = first_divergence(ref, out)
        if pos is None:
            continue
        gap = top2_gap(ref.logprobs[pos])
        note = (f"prompt {i} differs at token {pos} (gap {gap:.2e})\n"
                f"  ref {list(ref.token_ids)}\n  got {list(out.token_ids)}")
        (near_ties if gap < NEAR_TIE else errors).append(note)
    cap = max_near_ties(len(reference))
    if len(near_ties) > cap:
        errors.append(f"{len(near_ties)} near-tie divergences in {len(reference)} prompts, at most {cap} allowed:\n"
                      + "\n".join(near_ties))
    assert not errors, f"{label}:\n" + "\n".join(errors)
    return near_ties
