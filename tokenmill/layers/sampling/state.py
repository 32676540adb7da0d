"""SamplingState: the sampling state of the running requests, one slot each, on the device.

Slots 0..max_slots-1 belong to requests (the worker's persistent batch picks them); slot
`scratch_slot` (= max_slots) holds neutral greedy parameters, for rows whose sample is thrown away
(padding, a prompt chunk that does not end its prompt). Host calls are O(1) or O(request size)
and only queue writes; `flush()` applies the queue in a few batched copies (the sampler flushes
before every step). The host also counts which stages the active slots use (`plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.layers.sampling.plan import FeatureCounts, SamplingPlan, SlotFeatures
from tokenmill.layers.sampling.seeded_noise import seed_key, token_keys
from tokenmill.layers.sampling.slot_table import SlotRow, SlotTable
from tokenmill.layers.sampling.token_counts import SlotTokenCounts
from tokenmill.layers.sampling.token_lists import SlotTokenLists
from tokenmill.sampling_params import SamplingParams


class SamplingState:
    def __init__(self, max_slots: int, vocab_size: int, eos_token_ids: Sequence[int],
                 device: torch.device | str) -> None:
        self.max_slots = max_slots
        self.scratch_slot = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        num_slots = max_slots + 1
        self.table = SlotTable(num_slots, vocab_size, self.device)
        self.logit_bias = SlotTokenLists(num_slots, self.device)
        self.banned = SlotTokenLists(num_slots, self.device)  # min_tokens: EOS + stop ids, value -inf
        self.counts = SlotTokenCounts(num_slots, vocab_size, self.device)
        self._features = FeatureCounts()
        self._active: dict[int, SlotFeatures] = {}
        self._token_keys: torch.Tensor | None = None

    # ------------------------------------------------------------------ host API

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
            output_token_ids: Sequence[int] = ()) -> None:
        """A request takes `slot`: new, or resumed after preemption with the outputs it has."""
        assert 0 <= slot < self.max_slots, f"slot {slot} outside [0, {self.max_slots})"
        assert slot not in self._active, f"slot {slot} is taken; remove() it first"
        num_outputs = len(output_token_ids)
        banned = self._banned_ids(params) if params.min_tokens > num_outputs else ()
        features = SlotFeatures.of(params, self.vocab_size, bool(banned))
        self._active[slot] = features
        self._features.add(features)
        random = not features.greedy  # filters and temperature stay neutral on greedy slots
        self.table.write(slot, SlotRow(
            temperature=params.temperature if random else 1.0, top_p=params.top_p if random else 1.0,
            min_p=params.min_p if random else 0.0, repetition=params.repetition_penalty,
            frequency=params.frequency_penalty, presence=params.presence_penalty, greedy=features.greedy,
            top_k=features.top_k, seeded=features.seeded, seed_key=seed_key(params.seed) if features.seeded else 0,
            uses_penalties=features.penalties, min_tokens=params.min_tokens if banned else 0,
            num_outputs=num_outputs))
        bias = {t: b for t, b in (params.logit_bias or {}).items() if 0 <= t < self.vocab_size}
        self.logit_bias.write(slot, list(bias), list(bias.values()))
        self.banned.write(slot, banned, [float("-inf")] * len(banned))
        if features.penalties:
            self.counts.write(slot, output_token_ids, prompt_token_ids if features.repetition else None)

    def remove(self, slot: int) -> None:
        """The request leaves its slot (finished, aborted or preempted). Host-only: the device row
        stays as it is until the next add(); rows of a step must never point at a removed slot."""
        assert slot in self._active, f"slot {slot} is not taken"
        self._features.remove(self._active.pop(slot))

    @torch.inference_mode()
    def flush(self) -> None:
        """Push the queued writes to the device (asynchronous copies on CUDA)."""
        self.table.flush()
        self.logit_bias.flush()
        self.banned.flush()
        self.counts.flush()

    def allocate_penalty_state(self, repetition: bool = True) -> None:
        """Reserve the [slots, V] penalty tensors now (they are otherwise made on first use):
        int32 output counts (4 bytes/entry) and, with `repetition`, bool prompt presence (1 byte)."""
        with torch.inference_mode():
            self.counts.allocate(prompt=repetition)

    # ------------------------------------------------------------------ read by the sampler

    @property
    def plan(self) -> SamplingPlan:
        return self._features.plan

    @property
    def num_active(self) -> int:
        return len(self._active)

    def token_keys(self) -> torch.Tensor:
        if self._token_keys is None:
            with torch.inference_mode():
                self._token_keys = token_keys(self.vocab_size, self.device)
        return self._token_keys

    def _banned_ids(self, params: SamplingParams) -> list[int]:
        """What min_tokens bans: the model's EOS ids (even with ignore_eos) and the stop ids."""
        ids = set(self.eos_token_ids) | set(params.stop_token_ids or ())
        return sorted(t for t in ids if 0 <= t < self.vocab_size)

