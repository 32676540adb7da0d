"""The sampler: one step's logits [N, V] and slots [N] to one token id per row, on the device.

    raw logits -> logprobs (from the raw logits, when some slot asks)
    float32 copy -> logit_bias -> min_tokens -> repetition -> frequency / presence
    -> greedy rows: argmax (ties to the lowest id)
    -> random rows: / temperature -> top-k -> top-p -> min-p -> softmax -> exponential race

Random rows sample argmax(probs / E), E ~ Exp(1) i.i.d. per token, which picks token t with
probability probs[t]. Unseeded rows draw E from torch's generator (`exponential_`, capturable in a
CUDA graph); seeded rows from a hash of (seed, output position, token) (seeded_noise.py).

No Python work per row and no host sync: each stage is a few batched torch ops over the step, and
the host decides which stages run from counters over the active slots (plan.py). The plain greedy
step is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampling.adjustments import add_token_values, apply_penalties, ban_tokens
from tokenmill.layers.sampling.filters import apply_min_p, top_k_only, top_k_top_p
from tokenmill.layers.sampling.logprobs import LogprobsResult, compute_logprobs
from tokenmill.layers.sampling.plan import SamplingPlan
from tokenmill.layers.sampling.seeded_noise import row_keys, seeded_exponential
from tokenmill.layers.sampling.slot_table import FloatCol, IntCol, RowParams
from tokenmill.layers.sampling.state import SamplingState


@dataclass(frozen=True)
class SamplerOutput:
    sampled: torch.Tensor  # int64 [N], on the device
    logprobs: LogprobsResult | None  # set when some active slot asked for logprobs


class Sampler:
    def __init__(self, state: SamplingState) -> None:
        self.state = state

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, slots: torch.Tensor, *, record: bool = True) -> SamplerOutput:
        """logits: [N, V] float32 / bf16 / fp16 (left untouched); slots: int64 [N] on the same device,
        each an active slot or the scratch slot. With `record`, the sampled tokens are recorded
        (see `record`); pass False to sample without advancing the slots' state."""
        assert logits.dim() == 2 and logits.shape[1] == self.state.vocab_size, logits.shape
        self.state.flush()
        plan = self.state.plan
        if plan.plain_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            rows = self.state.table.gather(slots)
            x = self._adjust(logits, slots, rows, plan)
            sampled = self._draw(x, rows, plan) if plan.any_random else x.argmax(dim=-1)
        logprobs = None if plan.logprobs is None else compute_logprobs(logits, sampled, plan.logprobs)
        if record:
            self.record(slots, sampled)
        return SamplerOutput(sampled, logprobs)

    @torch.inference_mode()
    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each row's slot produced one output token: advance its output count (seeds and
        min_tokens read it) and, on penalty slots, count the token. Only the stages in use pay."""
        plan = self.state.plan
        table = self.state.table
        if plan.counts_outputs:
            table.count_outputs(slots)
        if plan.penalties:
            self.state.counts.record(slots, tokens, table.column(IntCol.USES_PENALTIES, slots))

    @torch.inference_mode()
    def adjusted_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """float32 [N, V]: the logits after bias, min_tokens and penalties (what greedy rows argmax)."""
        self.state.flush()
        return self._adjust(logits, slots, self.state.table.gather(slots), self.state.plan)

    # ------------------------------------------------------------------ stages

    def _adjust(self, logits: torch.Tensor, slots: torch.Tensor, rows: RowParams,
                plan: SamplingPlan) -> torch.Tensor:
        # A float32 copy: the caller's logits stay untouched, and the raw ones feed logprobs.
        x = logits.to(torch.float32, copy=True)
        state = self.state
        if plan.logit_bias:
            add_token_values(x, *state.logit_bias.gather(slots))
        if plan.min_tokens:
            active = rows.i(IntCol.NUM_OUTPUTS) < rows.i(IntCol.MIN_TOKENS)
            ban_tokens(x, *state.banned.gather(slots), active)
        if plan.penalties:
            counts = state.counts
            assert counts.output_counts is not None
            prompt_seen = None
            if plan.repetition:
                assert counts.prompt_seen is not None
                prompt_seen = counts.prompt_seen.index_select(0, slots)
            apply_penalties(
                x, counts.output_counts.index_select(0, slots), prompt_seen,
                rows.f(FloatCol.REPETITION) if plan.repetition else None,
                rows.f(FloatCol.FREQUENCY) if plan.frequency else None,
                rows.f(FloatCol.PRESENCE) if plan.presence else None)
        return x

    def _draw(self, x: torch.Tensor, rows: RowParams, plan: SamplingPlan) -> torch.Tensor:
        """Random rows sample; greedy rows (when the step mixes both) take the argmax of `x`."""
        greedy = x.argmax(dim=-1) if plan.any_greedy else None
        x.div_(rows.f(FloatCol.TEMPERATURE)[:, None])
        top_k = rows.i(IntCol.TOP_K)
        if plan.top_p:
            top_k_top_p(x, top_k if plan.top_k else None, rows.f(FloatCol.TOP_P))
        elif plan.top_k:
            top_k_only(x, top_k, plan.top_k)
        if plan.min_p:
            apply_min_p(x, rows.f(FloatCol.MIN_P))
        probs = x.softmax(dim=-1)
        sampled = probs.div_(self._noise(x, rows, plan)).argmax(dim=-1)
        if greedy is not None:
            sampled = torch.where(rows.i(IntCol.GREEDY) != 0, greedy, sampled)
        return sampled

    def _noise(self, buffer: torch.Tensor, rows: RowParams, plan: SamplingPlan) -> torch.Tensor:
        """Exp(1) noise [N, V]: hashed on seeded rows, torch's generator elsewhere. `buffer` is
        a free float32 [N, V] tensor (the filtered logits, no longer needed once probs exist)."""
        if not plan.seeded:
            # E = 0 would turn a zero-probability token into 0/0.
            return buffer.exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
        keys = row_keys(rows.i(IntCol.SEED_KEY), rows.i(IntCol.NUM_OUTPUTS))
        seeded = seeded_exponential(keys, self.state.token_keys())
        if not plan.unseeded:
            return seeded  # every non-seeded row of the step is greedy or scratch: any noise will do
        unseeded = buffer.exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
        return torch.where((rows.i(IntCol.SEEDED) != 0)[:, None], seeded, unseeded, out=seeded)
