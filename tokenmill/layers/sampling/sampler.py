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

Speculative decoding (spec_verify.py builds on these): a row may stand at an output position ahead
of its slot's count (`offsets`: a request with k drafts has k + 1 rows, offsets 0..k), `probs` gives
the distribution a row samples from, `draw` samples given weights and `uniforms` gives acceptance
uniforms, each from its own noise stream; `advance` moves the slots past the tokens a step emitted.
Speculation is never used for requests with penalties (their counts would miss the drafts ahead of
the row) or logprobs; such requests may share the step as rows with offset 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.sampling.adjustments import add_token_values, apply_penalties, ban_tokens
from tokenmill.layers.sampling.filters import apply_min_p, top_k_only, top_k_top_p
from tokenmill.layers.sampling.logprobs import LogprobsResult, compute_logprobs
from tokenmill.layers.sampling.plan import SamplingPlan
from tokenmill.layers.sampling.row_argmax import row_argmax
from tokenmill.layers.sampling.noise import exponential_noise, output_positions, uniform_noise
from tokenmill.layers.sampling.seeded_noise import NoiseStream
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
    def sample(self, logits: torch.Tensor, slots: torch.Tensor, *, offsets: torch.Tensor | None = None,
               record: bool = True) -> SamplerOutput:
        """logits: [N, V] float32 / bf16 / fp16 (left untouched); slots: int64 [N] on the same device,
        each an active slot or the scratch slot. `offsets` (int64 [N], None = zeros): row i stands at
        output position NUM_OUTPUTS[slot] + offsets[i] (seeded noise and min_tokens read it). With
        `record`, the sampled tokens are recorded (see `record`); pass False to sample without
        advancing the slots' state (required with offsets: see `advance`)."""
        assert logits.dim() == 2 and logits.shape[1] == self.state.vocab_size, logits.shape
        assert offsets is None or not record, "rows with offsets are not recorded: call advance()"
        self.state.flush()
        plan = self.state.plan
        if plan.plain_greedy:
            sampled = row_argmax(logits)
        else:
            rows = self.state.table.gather(slots)
            x = self._adjust(logits, slots, rows, plan, offsets)
            sampled = self._draw(x, rows, plan, offsets) if plan.any_random else row_argmax(x)
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
    def advance(self, slots: torch.Tensor, num_emitted: torch.Tensor, emitted: torch.Tensor | None = None) -> None:
        """A speculative step's `record`: slots[r] (int64 [R], each at most once) produced
        num_emitted[r] tokens (int64 [R]), emitted[r, :num_emitted[r]] (int64 [R, K + 1]). `emitted`
        is needed only while some active slot uses penalties (rows without drafts may be penalty
        requests; their one token is counted)."""
        plan = self.state.plan
        assert emitted is not None or not plan.penalties, "an active slot uses penalties: pass the emitted tokens"
        self.state.flush()
        table = self.state.table
        if plan.counts_outputs:
            table.count_outputs(slots, num_emitted)
        if plan.penalties:
            width = emitted.shape[1]
            kept = torch.arange(width, device=emitted.device)[None, :] < num_emitted[:, None]
            weights = kept * table.column(IntCol.USES_PENALTIES, slots)[:, None]
            self.state.counts.record(slots[:, None].expand(-1, width).reshape(-1), emitted.clamp_min(0).reshape(-1),
                                     weights.reshape(-1))

    @torch.inference_mode()
    def adjusted_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """float32 [N, V]: the logits after bias, min_tokens and penalties (what greedy rows argmax)."""
        self.state.flush()
        return self._adjust(logits, slots, self.state.table.gather(slots), self.state.plan)

    # ------------------------------------------------------------------ speculative decoding

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, V]: the distribution `sample` draws row i from (after logit_bias, min_tokens,
        temperature, top-k, top-p, min-p); greedy rows: one-hot of the argmax. `logits` untouched.
        Peak memory: two float32 [N, V] tensors (the adjusted logits, then the result)."""
        assert logits.dim() == 2 and logits.shape[1] == self.state.vocab_size, logits.shape
        self.state.flush()
        plan = self.state.plan
        if plan.plain_greedy:
            return _one_hot(row_argmax(logits, keepdim=True), torch.zeros_like(logits, dtype=torch.float32))
        rows = self.state.table.gather(slots)
        x = self._adjust(logits, slots, rows, plan, offsets)
        if not plan.any_random:
            return _one_hot(row_argmax(x, keepdim=True), x.zero_())
        greedy = row_argmax(x, keepdim=True) if plan.any_greedy else None
        probs = self._filtered_probs(x, rows, plan)
        if greedy is not None:  # one-hot on greedy rows, the softmax elsewhere
            is_greedy = (rows.i(IntCol.GREEDY) != 0)[:, None]
            kept = torch.where(is_greedy, 1.0, probs.gather(1, greedy))
            probs.masked_fill_(is_greedy, 0.0).scatter_(1, greedy, kept)
        return probs

    @torch.inference_mode()
    def draw(self, probs: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor | None = None,
             stream: int | torch.Tensor = NoiseStream.MAIN) -> torch.Tensor:
        """int64 [N]: one token per row of `probs` (float32 [N, V] non-negative weights, not all zero;
        they need not sum to 1; left untouched), by the exponential race with `stream`'s noise (an
        int, or int64 [N] per row) at the rows' output positions. Greedy rows: the argmax."""
        self.state.flush()
        plan = self.state.plan
        if not plan.any_random:
            return row_argmax(probs)
        rows = self.state.table.gather(slots)
        noise = exponential_noise(probs, rows, plan, self.state.token_keys(), offsets, stream)
        sampled = row_argmax(torch.div(probs, noise, out=noise))
        if plan.any_greedy:
            sampled = torch.where(rows.i(IntCol.GREEDY) != 0, row_argmax(probs), sampled)
        return sampled

    @torch.inference_mode()
    def uniforms(self, slots: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor,
                 stream: int | torch.Tensor = NoiseStream.ACCEPT) -> torch.Tensor:
        """float32 [N, M] in (0, 1): one uniform per row and offset (int64 [N, M]); seeded rows hash
        (seed, output position, tokens[i, j], stream), others draw from torch's generator."""
        self.state.flush()
        rows = self.state.table.gather(slots)
        return uniform_noise(rows, self.state.plan, self.state.token_keys(), offsets, tokens, stream)

    # ------------------------------------------------------------------ stages

    def _adjust(self, logits: torch.Tensor, slots: torch.Tensor, rows: RowParams,
                plan: SamplingPlan, offsets: torch.Tensor | None = None) -> torch.Tensor:
        # A float32 copy: the caller's logits stay untouched, and the raw ones feed logprobs.
        x = logits.to(torch.float32, copy=True)
        state = self.state
        if plan.logit_bias:
            add_token_values(x, *state.logit_bias.gather(slots))
        if plan.min_tokens:
            active = output_positions(rows, offsets) < rows.i(IntCol.MIN_TOKENS)
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

    def _filtered_probs(self, x: torch.Tensor, rows: RowParams, plan: SamplingPlan) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p (in place on `x`), then the softmax (a new tensor)."""
        x.div_(rows.f(FloatCol.TEMPERATURE)[:, None])
        top_k = rows.i(IntCol.TOP_K)
        if plan.top_p:
            top_k_top_p(x, top_k if plan.top_k else None, rows.f(FloatCol.TOP_P))
        elif plan.top_k:
            top_k_only(x, top_k, plan.top_k)
        if plan.min_p:
            apply_min_p(x, rows.f(FloatCol.MIN_P))
        return x.softmax(dim=-1)

    def _draw(self, x: torch.Tensor, rows: RowParams, plan: SamplingPlan,
              offsets: torch.Tensor | None) -> torch.Tensor:
        """Random rows sample; greedy rows (when the step mixes both) take the argmax of `x`."""
        greedy = row_argmax(x) if plan.any_greedy else None
        probs = self._filtered_probs(x, rows, plan)
        # `x` is free once probs exist: the generator's noise goes there.
        noise = exponential_noise(x, rows, plan, self.state.token_keys(), offsets, buffer=x)
        sampled = row_argmax(probs.div_(noise))
        if greedy is not None:
            sampled = torch.where(rows.i(IntCol.GREEDY) != 0, greedy, sampled)
        return sampled


def _one_hot(index: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """zeros [N, V] with 1.0 at index [N, 1] of each row."""
    return zeros.scatter_(1, index, 1.0)
