"""Adaptive speculation: how many draft tokens each running request verifies in the next step.

The worker proposes drafts at the end of a step (for use in the next) only when the scheduler
asks (`SchedulerOutput.propose`); the scheduler then gives each decode row k_r <= K draft slots.
A row's j-th draft is worth its chance of being accepted, estimated as alpha_r**j from the row's
recent acceptance (alpha_r: per-position acceptance, a decayed count with a prior of 1/2).
Drafts are not free: a step costs about the same as a one-token-per-row step only while its
tokens stay under `max_step_tokens` (the point where a forward pass stops being bound by reading
the weights). So each step hands out the tokens left under that line, once every row's own
tokens (a prompt's chunks included) are counted, to the most valuable draft positions, none
below `min_acceptance`; while prompts wait to start, their prefill takes the step and nothing
is drafted or proposed; tokens still left after that cost about nothing, so rows
that draft take further positions with them, up to K (most valuable first). At saturation nothing
is left: no drafts, no proposing, the one-token path exactly as without speculation.
`max_step_tokens=0` always drafts K.

With `padded_verification` (CUDA verification graphs) a step that verifies any draft computes
1 + K positions for every row, so it costs rows * (1 + K) tokens whoever drafts: a step drafts
only when that fits under the line (and every row is a decode), and then its rows take all
their room.

A row whose estimate fell below the line gets one probing draft every `PROBE_EVERY` steps when
tokens are left, so that a request that starts repeating itself is noticed.

Whether speculating pays at all is measured, not assumed (spec_cost.py): a speculative step
takes `ratio` times a plain step's time at the same batch size, so it pays when the drafts it is
expected to accept beat the tokens a plain step would make in that extra time:
sum over rows of sum_j alpha_r**j >= (ratio - 1) * rows. The workers are asked to propose only
then (and so, after a while without, drop the proposer's state: below). Where the other
regime has never been measured at this batch size, or the choice is close and its measurement
old, the policy takes the other regime for two steps to measure it (nothing is tried where no
row is expected to accept anything).

Rows eligible for drafts: the request allows it (no penalties, logprobs or prompt logprobs:
their per-position state would need every draft applied in order), the row is a plain decode
(one uncomputed token), the worker proposed for it at the end of the previous step, and the
request has room for 1 + k more tokens under its limit.

Dormant proposer state (`ProposerState`): proposing needs per-request state on the device that
every step keeps current at a cost: the n-gram proposer's histories (prompt and every emitted
token: a few kernels per step), a draft model's KV (its forward over every step's inputs). So the
workers hold it only while proposals are asked for: after `DORMANT_AFTER` steps without one
(`SETTLED_AFTER` when the requests in sight, running and waiting, are too many for any to draft)
they drop it, and each step is then the plain one. When proposing resumes, the step carries every
running request's tokens as this process knows them, and whether a sampled token still in
flight follows them (the worker has that one on the device: the row's next input); the worker
rebuilds the histories from them, or runs the draft over every position computed so far.
(After a dormant spell, blocks in the prefix cache may lack the draft's KV: the worker runs the
draft over a new request's cached prefix too.)
"""

from __future__ import annotations

import numpy as np

from tokenmill.config import SpeculativeConfig
from tokenmill.core.running_table import RunningTable
from tokenmill.core.spec_cost import StepCosts
from tokenmill.protocol import ProposerResume, SpecDecodeStats
from tokenmill.sampling_params import SamplingParams

PROBE_EVERY = 16
DECAY = 0.8  # weight of the past in the acceptance counts, per verified step
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # alpha starts at 1/2
DORMANT_AFTER = 8  # steps without proposals before the workers drop the proposer state
SETTLED_AFTER = 3  # ... the fewest: no drafts in flight, none read back uncorrected


def allows_speculation(params: SamplingParams) -> bool:
    # Constrained rows (structured outputs) draft too: each draft position is masked under the
    # grammar state after the drafts before it (core/grammar_masks.py). Not when the grammar can
    # end without ending the request (ignore_eos, min_tokens): tokens drafted past its end would
    # be emitted in the same step.
    constrained_ok = params.structured_outputs is None or (not params.ignore_eos and not params.min_tokens)
    return (params.logprobs is None and params.prompt_logprobs is None and params.presence_penalty == 0.0
            and constrained_ok
            and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0)


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, table: RunningTable) -> None:
        self.config = config
        self.table = table
        self.k = config.num_speculative_tokens
        self.drafts_of_slot = np.zeros(table.max_rows, np.int64)  # the last plan's, by slot (scratch)
        self.costs = StepCosts(table.max_rows)
        self._trying: tuple[int, bool] | None = None  # (last step, regime): measuring the other regime

    def choose(self, step_id: int, slots: np.ndarray, budget: int, prompts_waiting: bool = False) -> np.ndarray:
        """Draft tokens per slot (an int64 array over every slot; zero for rows not in `slots`)
        for step `step_id`, whose running rows are `slots` and whose token budget is `budget`.
        `prompts_waiting`: prompts wait to start, so their prefill takes what the rows leave."""
        t, drafts = self.table, self.drafts_of_slot
        drafts[:] = 0
        cap = self.config.max_step_tokens
        if not len(slots) or (cap and prompts_waiting):
            return drafts
        ahead = t.num_tokens[slots] + t.num_pending[slots]
        uncomputed = ahead - t.num_computed[slots]  # 1 for a decode row, more for a prompt's chunks
        room = np.minimum(t.token_limit[slots] - ahead - 1, self.k)
        eligible = (t.spec_ok[slots] & (uncomputed == 1) & (t.proposed_at[slots] == step_id - 1) & (room > 0))
        rows = eligible.nonzero()[0]
        if not len(rows):
            return drafts
        room, eligible_slots = room[rows], slots[rows]
        claimed = int(uncomputed.sum())  # what the rows take anyway, prompt chunks included
        free = min(budget, cap) - claimed if cap else budget - claimed
        if cap and self.config.padded_verification:
            # Every row computes 1 + K positions once any row drafts: all or nothing.
            all_decode = bool((uncomputed <= 1).all())  # (a graph step holds no prompt chunk)
            free = len(rows) * self.k if all_decode and self._padded_step_fits(len(slots), budget) else 0
        if free <= 0:
            return drafts
        if not cap:  # always speculate, as far as the budget goes
            drafts[eligible_slots] = np.minimum(room, free // len(rows))
            return drafts
        alpha = (t.spec_hits[eligible_slots] + PRIOR_HITS) / (t.spec_trials[eligible_slots] + PRIOR_TRIALS)
        if free >= len(rows) * self.k:
            # Tokens for every position of every row (small batches): nothing to rank.
            # `ranked_counts` then gives a row above the line all its room and a probed row one.
            low = alpha < self.config.min_acceptance
            probe = low & ((step_id + eligible_slots) % PROBE_EVERY == 0)
            drafts[eligible_slots] = np.where(low, probe, room)
        else:
            drafts[eligible_slots] = self.ranked_counts(step_id, eligible_slots, alpha, room, free)
        return drafts

    def ranked_counts(self, step_id: int, slots: np.ndarray, alpha: np.ndarray, room: np.ndarray,
                      free: int) -> np.ndarray:
        """Draft counts for eligible rows (`slots`, their acceptance estimates and room): the
        `free` tokens go to the most valuable positions, then to further positions of rows
        already drafting."""
        value = alpha[:, None] ** np.arange(1, self.k + 1)  # [rows, K]: chance the j-th draft is accepted
        value[np.arange(self.k)[None, :] >= room[:, None]] = 0.0
        probe = ((step_id + slots) % PROBE_EVERY == 0) & (value[:, 0] < self.config.min_acceptance)
        value[probe, 0] = self.config.min_acceptance  # one cheap look at a row we had given up on
        flat = value.ravel()
        worth = (flat >= self.config.min_acceptance).nonzero()[0]
        if len(worth) > free:
            worth = worth[np.argpartition(-flat[worth], free - 1)[:free]]
        # alpha**j falls with j, so each row's picks are a prefix: counting them is enough.
        counts = np.bincount(worth // self.k, minlength=len(slots))
        left = free - len(worth)
        if left > 0:
            # Tokens still free under the cap cost about nothing (the step is bound by reading the
            # weights; on CUDA the verification graph computes k + 1 positions anyway), so rows
            # already drafting (not just probing) take further positions, most valuable first.
            further = ((counts > 0) & ~probe)[:, None] & (np.arange(self.k)[None, :] >= counts[:, None]) & (value > 0)
            extra = further.ravel().nonzero()[0]
            if len(extra) > left:
                extra = extra[np.argpartition(-flat[extra], left - 1)[:left]]
            counts += np.bincount(extra // self.k, minlength=len(slots))
        return counts

    def wants_proposals(self, step_id: int, num_running: int, prompts_waiting: bool = False) -> bool:
        """Should the workers propose drafts at the end of step `step_id`, which has this many
        rows? Only if the next step could have tokens left for drafts (not while prompts wait to
        start: their prefill takes the next step's tokens), and speculating pays (measured)."""
        if not self.config.max_step_tokens:
            return True
        return self.fits(num_running) and not prompts_waiting and self._pays(step_id)

    def fits(self, num_rows: int) -> bool:
        """Whether a step of this many rows could have tokens left for drafts."""
        cap = self.config.max_step_tokens
        if self.config.padded_verification:
            return self._padded_step_fits(num_rows, cap)
        return num_rows < cap  # a token left for a draft

    def _pays(self, step_id: int) -> bool:
        """Whether the running rows' expected accepted drafts beat a speculative step's extra time
        (or the other regime is being measured)."""
        if self._trying is not None and self._trying[0] >= step_id:
            return self._trying[1]
        rows = self.table.order
        gain = self.expected_gain(rows)
        need = (self.costs.ratio(len(rows)) - 1.0) * len(rows)
        pays = gain >= need
        other = not pays
        if gain > 0 and (self.costs.untried(other, len(rows)) or
                         (need / 2 <= gain <= 2 * need and self.costs.stale(other, len(rows), step_id))):
            self._trying = (step_id + 1, other)  # two steps: the second is a clean measurement
            self.costs.claim(other, len(rows), step_id)
            return other
        return pays

    def expected_gain(self, slots: np.ndarray) -> float:
        """Drafts these rows are expected to have accepted in a step where each above the line
        takes all its room: sum_r sum_{j <= room_r} alpha_r**j."""
        t = self.table
        room = np.clip(t.token_limit[slots] - t.num_tokens[slots] - t.num_pending[slots] - 1, 0, self.k)
        alpha = (t.spec_hits[slots] + PRIOR_HITS) / (t.spec_trials[slots] + PRIOR_TRIALS)
        drafting = t.spec_ok[slots] & (alpha >= self.config.min_acceptance)
        alpha, room = alpha[drafting], room[drafting]
        return float((alpha * (1.0 - alpha ** room) / (1.0 - alpha)).sum())

    def observe(self, speculative: bool, num_rows: int, seconds: float, step_id: int) -> None:
        """A step of one regime took `seconds` (see spec_cost.py)."""
        self.costs.observe(speculative, num_rows, seconds, step_id)

    def _padded_step_fits(self, num_rows: int, budget: int) -> bool:
        """With padded verification: whether a drafting step of `num_rows` rows (1 + K positions
        each) stays under `max_step_tokens` and `budget`."""
        return num_rows * (1 + self.k) <= min(budget, self.config.max_step_tokens)

    def record(self, slot: int, num_drafts: int, num_accepted: int) -> None:
        """A verified step of the row: `num_accepted` of its `num_drafts` drafts were accepted."""
        t = self.table
        trials = num_accepted + (num_accepted < num_drafts)  # a geometric run: stops at the first miss
        t.spec_hits[slot] = t.spec_hits[slot] * DECAY + num_accepted
        t.spec_trials[slot] = t.spec_trials[slot] * DECAY + trials


class ProposerState:
    """Whether the workers hold the proposer's state, and the messages that change it."""

    def __init__(self, table: RunningTable) -> None:
        self.table = table
        self.live = False  # nothing is held until the first proposal
        self._idle_steps = 0

    def idle(self, saturated: bool = False) -> bool:
        """A step without proposals; `saturated`: the requests in sight (running and waiting) are
        too many for any to draft, so none will for a while. True: the workers drop the state
        with this step."""
        self._idle_steps += 1
        # (Drafts come only in the step after a proposal; two steps later their count is settled
        # on both sides: the state can go then, no sooner.)
        due = self._idle_steps >= (SETTLED_AFTER if saturated else DORMANT_AFTER)
        if self.live and due:
            self.live = False
            return True
        return False

    def proposing(self, sampling_slots: np.ndarray) -> ProposerResume | None:
        """A step at whose end the workers propose; `sampling_slots`: its rows that sample. Returns
        what to rebuild the state from before the step, when the workers hold none."""
        self._idle_steps = 0
        if self.live:
            return None
        self.live = True
        t = self.table
        order = t.order
        samples_now = np.zeros(t.max_rows, np.int64)
        samples_now[sampling_slots] = 1
        # Tokens in flight from earlier steps (this step's own sample is not in the history yet).
        # Dormant since at least SETTLED_AFTER steps after the last proposal: no drafts in flight,
        # so at most the last step's token.
        pending = t.num_pending[order] - samples_now[order]
        assert ((pending == 0) | (pending == 1)).all(), f"in-flight tokens per row: {pending.tolist()}"
        counts = t.num_tokens[order]
        known = np.arange(t.tokens.shape[1])[None, :] < counts[:, None]
        return ProposerResume.pack(t.handle[order], counts, t.tokens[order][known], pending)


class SpecStats:
    """Counters of verified drafts since the engine started (reported in SchedulerStats)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0  # verified steps of a request with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.per_position = np.zeros(k, np.int64)  # accepted (j+1)-th drafts

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted += num_accepted
        self.per_position[:num_accepted] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted, self.per_position.tolist())
