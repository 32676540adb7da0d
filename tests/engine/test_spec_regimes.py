"""The adaptive speculation policy switching regime mid-run: a scripted step-time ratio
(`helpers/engine.script_spec_cost`) makes speculating pay for some stretches of steps and not for
others, so the engine goes from speculative steps to plain ones and back several times (async on
and off; the proposer's state dropped while plain and rebuilt), and every request's tokens must
stay the plain engine's, greedy and seeded. Only steps of decode rows alone, in one regime, may
reach the cost table: never a step with a prompt chunk, nor one that verifies drafts without
proposing more (or proposes without verifying any)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import repetitive_prompts, token_ids
from tests.helpers.engine import script_spec_cost
from tokenmill import SamplingParams

CHEAP, DEAR = 1.0, 50.0  # speculating costs nothing more / fifty times a plain step


def ratio_in_phases(step_id: int) -> float:
    """Phases of uneven length (7, 11, 7, 11, ...): speculative steps, then plain ones, then again."""
    phase = step_id % 18
    return CHEAP if phase < 7 else DEAR


def spy_steps(llm) -> dict[int, object]:
    """step_id -> the SchedulerOutput of every step the engine scheduled."""
    scheduler, steps = llm.engine.scheduler, {}
    real = scheduler.schedule

    def schedule():
        so = real()
        if so is not None:
            steps[so.step_id] = so
        return so
    scheduler.schedule = schedule
    return steps


def kind(so) -> str:
    """What a step is, from what it scheduled (independently of `Scheduler.observe_step`)."""
    if not len(so.row_slots):
        return "empty"
    verifies = so.num_drafts is not None
    decode_tokens = len(so.row_slots) + (int(so.num_drafts.sum()) if so.num_drafts is not None else 0)
    if so.new_requests or so.total_num_scheduled_tokens != decode_tokens:
        return "prompt"
    if verifies != so.propose:
        return "mixed"
    return "speculative" if verifies else "plain"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_switching_regimes_mid_run_changes_no_token(tiny_model_dir, async_scheduling):
    prompts = repetitive_prompts(10, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 7 * i, ignore_eos=True) for i in range(6)] + [
        SamplingParams(temperature=0.9, top_k=30, seed=40 + i, max_tokens=45 + 5 * i, ignore_eos=True)
        for i in range(4)]
    plain = tiny_llm(tiny_model_dir, async_scheduling=False, max_num_seqs=4, max_num_batched_tokens=24)
    want = token_ids(plain, prompts, params)
    plain.shutdown()
    # Four seats for ten requests: prompts start (in chunks of the 24-token budget) while others decode.
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=24,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 24})
    observed = script_spec_cost(llm, ratio_in_phases)
    steps = spy_steps(llm)
    assert token_ids(llm, prompts, params) == want

    proposing = [steps[s].propose for s in sorted(steps)]
    switches = sum(a != b for a, b in zip(proposing, proposing[1:]))
    kinds = {s: kind(so) for s, so in steps.items()}
    stats = llm.scheduler_stats()
    assert switches >= 6, proposing
    # The plain stretches outlast DORMANT_AFTER: the proposer's state went and came back.
    dormant = sum(bool(so.proposer_dormant) for so in steps.values())
    resumed = sum(so.proposer_resume is not None for so in steps.values())
    assert dormant >= 2 and resumed >= 2, (dormant, resumed)
    assert stats["spec_num_accepted_tokens"] > 20, stats
    counted = {s for _, _, s in observed}
    assert counted, "no step reached the cost table"
    # What reached the table is what a step was: its regime, its rows; nothing else reached it.
    for speculative, rows, s in observed:
        assert kinds[s] == ("speculative" if speculative else "plain"), (s, kinds[s], speculative)
        assert rows == len(steps[s].row_slots)
    skipped = {k for s, k in kinds.items() if s not in counted}
    assert {"prompt", "mixed"} <= skipped, skipped  # both happened, and were left out
    assert not {kinds[s] for s in counted} & {"prompt", "mixed"}
    assert counted == {s for s, k in kinds.items() if k in ("plain", "speculative")}
    assert {kinds[s] for s in counted} == {"plain", "speculative"}
    llm.shutdown()
