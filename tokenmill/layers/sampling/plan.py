"""Which sampling stages a step runs, decided on the host in O(1) from counts over the active slots.

A stage that no active slot needs is skipped entirely. Every slot that does not use a stage holds
neutral values for it (temperature 1, top-k off, no bias, penalty 1/0, ...), and so does the
scratch slot, so running a stage over every row of a step is always correct: the plan may be
decided from the active set instead of from the exact rows of the step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class SlotFeatures:
    """What one request asks of the sampler, derived once when it is added."""

    greedy: bool
    top_k: int  # effective top-k of a random request, in [1, V); 0 = off
    top_p: bool
    min_p: bool
    seeded: bool  # a random request with a seed (a greedy request needs no randomness)
    logit_bias: bool
    min_tokens: bool  # it still has tokens to ban (EOS / stop ids) before reaching min_tokens
    repetition: bool
    frequency: bool
    presence: bool
    logprobs: int | None
    structured: bool = False  # samples under a grammar's token mask (applied to the logits first)

    @staticmethod
    def of(params: SamplingParams, vocab_size: int, bans_tokens: bool) -> SlotFeatures:
        greedy = params.greedy
        random = not greedy
        top_k = params.top_k if random and 0 < params.top_k < vocab_size else 0
        return SlotFeatures(
            greedy=greedy, top_k=top_k, top_p=random and params.top_p < 1.0, min_p=random and params.min_p > 0.0,
            seeded=random and params.seed is not None, logit_bias=bool(params.logit_bias),
            min_tokens=bans_tokens, repetition=params.repetition_penalty != 1.0,
            frequency=params.frequency_penalty != 0.0, presence=params.presence_penalty != 0.0,
            logprobs=params.logprobs, structured=params.structured_outputs is not None)

    @property
    def penalties(self) -> bool:
        return self.repetition or self.frequency or self.presence

    def flags(self) -> tuple[str, ...]:
        """Names of the on/off stages this request needs (keys of FeatureCounts' counter)."""
        names = ["greedy" if self.greedy else "random"]
        if not self.greedy:
            names.append("seeded" if self.seeded else "unseeded")
        names += [name for name in ("top_p", "min_p", "logit_bias", "min_tokens", "repetition", "frequency",
                                    "presence", "structured") if getattr(self, name)]
        return tuple(names)


@dataclass(frozen=True)
class SamplingPlan:
    """The stages of one step. Host-only; its ints are the shapes of the stages that use them."""

    any_greedy: bool = False
    any_random: bool = False
    top_k: int = 0  # largest top-k among the active slots; 0 = no top-k stage
    top_p: bool = False
    min_p: bool = False
    seeded: bool = False  # some random slot draws hashed noise from its seed
    unseeded: bool = False  # some random slot draws from torch's generator
    logit_bias: bool = False
    min_tokens: bool = False
    repetition: bool = False
    frequency: bool = False
    presence: bool = False
    logprobs: int | None = None  # top-k width of the logprobs stage (0 = sampled token only); None = off
    structured: bool = False  # some slot samples under a grammar mask (the masked greedy step-end graph)

    @property
    def penalties(self) -> bool:
        return self.repetition or self.frequency or self.presence

    @property
    def adjusts_logits(self) -> bool:
        return self.logit_bias or self.min_tokens or self.penalties

    @property
    def plain_greedy(self) -> bool:
        """The whole step is one argmax of the raw logits."""
        return not self.any_random and not self.adjusts_logits

    @property
    def counts_outputs(self) -> bool:
        """Some active slot reads its output count on the device (seeds, min_tokens)."""
        return self.seeded or self.min_tokens


class FeatureCounts:
    """How many active slots use each stage; the plan is rebuilt only after a change."""

    def __init__(self) -> None:
        self._flags: Counter[str] = Counter()
        self._top_k: Counter[int] = Counter()  # multiset of active top-k values, for the max
        self._logprobs: Counter[int] = Counter()
        self._plan: SamplingPlan | None = SamplingPlan()

    def add(self, features: SlotFeatures) -> None:
        self._update(features, +1)

    def remove(self, features: SlotFeatures) -> None:
        self._update(features, -1)

    def _update(self, features: SlotFeatures, delta: int) -> None:
        for name in features.flags():
            _bump(self._flags, name, delta)
        if features.top_k:
            _bump(self._top_k, features.top_k, delta)
        if features.logprobs is not None:
            _bump(self._logprobs, features.logprobs, delta)
        self._plan = None

    @property
    def plan(self) -> SamplingPlan:
        if self._plan is None:
            on = self._flags
            self._plan = SamplingPlan(
                any_greedy=on["greedy"] > 0, any_random=on["random"] > 0,
                top_k=max(self._top_k, default=0), top_p=on["top_p"] > 0, min_p=on["min_p"] > 0,
                seeded=on["seeded"] > 0, unseeded=on["unseeded"] > 0, logit_bias=on["logit_bias"] > 0,
                min_tokens=on["min_tokens"] > 0, repetition=on["repetition"] > 0,
                frequency=on["frequency"] > 0, presence=on["presence"] > 0,
                logprobs=max(self._logprobs, default=None), structured=on["structured"] > 0)
        return self._plan


def _bump(counter: Counter, key, delta: int) -> None:
    counter[key] += delta
    assert counter[key] >= 0, f"{key} removed more often than added"
    if counter[key] == 0:
        del counter[key]
