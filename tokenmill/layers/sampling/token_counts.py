"""Per-slot token statistics for the penalties, on the device: output counts and prompt presence.

`output_counts` (int32 [slots, V]) is allocated when the first penalty request arrives and
`prompt_seen` (bool [slots, V]) when the first repetition-penalty request does; `allocate()` lets
the worker reserve them up front (e.g. before sizing the KV cache). Only the rows of slots whose
request uses penalties are ever written: `write` rebuilds a row from the request's tokens when it
is added, and `record` adds each step's sampled token with weight 1 on those slots and 0 elsewhere.
A row left over from an earlier request is harmless: its slot's penalties are neutral (1, 0, 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.layers.sampling.upload import upload


class SlotTokenCounts:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        # slot -> (output ids, prompt ids or None when the prompt is not needed); last write wins
        self._pending: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def allocate(self, prompt: bool) -> None:
        shape = (self.num_slots, self.vocab_size)
        if self.output_counts is None:
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        if prompt and self.prompt_seen is None:
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def write(self, slot: int, output_ids: Sequence[int], prompt_ids: Sequence[int] | None) -> None:
        self._pending[slot] = (np.asarray(output_ids, dtype=np.int64),
                               None if prompt_ids is None else np.asarray(prompt_ids, dtype=np.int64))

    def flush(self) -> None:
        if not self._pending:
            return
        self.allocate(prompt=any(p is not None for _, p in self._pending.values()))
        slots = np.fromiter(self._pending, dtype=np.int64, count=len(self._pending))
        outputs = [o for o, _ in self._pending.values()]
        prompt_slots = np.array([s for s, (_, p) in self._pending.items() if p is not None], dtype=np.int64)
        prompts = [p for _, p in self._pending.values() if p is not None]
        self._pending.clear()
        v = self.vocab_size
        # Flat indices slot * V + token, for every output (and prompt) token, built with numpy.
        out_flat = _flat_indices(slots, outputs, v)
        prompt_flat = _flat_indices(prompt_slots, prompts, v)
        # One host->device copy carries all four index lists.
        parts = [slots, out_flat, prompt_slots, prompt_flat]
        packed = upload(torch.from_numpy(np.concatenate(parts)), self.device)
        slots_d, out_d, prompt_slots_d, prompt_d = packed.split([len(p) for p in parts])
        assert self.output_counts is not None
        self.output_counts.index_fill_(0, slots_d, 0)
        if len(out_d):
            self.output_counts.view(-1).index_add_(0, out_d, torch.ones_like(out_d, dtype=torch.int32))
        if len(prompt_slots_d):
            assert self.prompt_seen is not None
            self.prompt_seen.index_fill_(0, prompt_slots_d, False)
            self.prompt_seen.view(-1).index_fill_(0, prompt_d, True)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> None:
        """output_counts[slots[i], tokens[i]] += weights[i] (1 on penalty slots, 0 elsewhere)."""
        assert self.output_counts is not None
        flat = slots * self.vocab_size + tokens
        self.output_counts.view(-1).index_add_(0, flat, weights.to(torch.int32))


def _flat_indices(slots: np.ndarray, token_lists: list[np.ndarray], vocab_size: int) -> np.ndarray:
    if not token_lists:
        return np.zeros(0, dtype=np.int64)
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
    tokens = np.concatenate(token_lists)
    flat = tokens + np.repeat(slots * vocab_size, lengths)
    return flat[(tokens >= 0) & (tokens < vocab_size)]  # an id outside the vocab cannot be sampled
