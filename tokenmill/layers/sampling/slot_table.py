"""Per-slot scalar sampling parameters on the device, in two packed tables (float32 and int64).

One step reads every parameter of its rows with two gathers (`gather`), and a flush writes every
queued slot with two host->device copies. Rows hold neutral values when a request does not use a
stage (see plan.py), so the scratch slot and unused columns never change a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from tokenmill.layers.sampling.upload import upload


class FloatCol(IntEnum):
    TEMPERATURE = 0  # 1.0 on greedy slots, so dividing by it is harmless
    TOP_P = 1  # 1.0 = off
    MIN_P = 2  # 0.0 = off
    REPETITION = 3  # 1.0 = off
    FREQUENCY = 4  # 0.0 = off
    PRESENCE = 5  # 0.0 = off


class IntCol(IntEnum):
    GREEDY = 0  # 1 = argmax of the adjusted logits
    TOP_K = 1  # vocab size = off
    SEEDED = 2  # 1 = noise from the seed hash
    SEED_KEY = 3  # 32-bit key of the seed (seeded_noise.seed_key)
    USES_PENALTIES = 4  # 1 = its output tokens are counted into the [slots, V] counts
    MIN_TOKENS = 5  # ban EOS / stop ids while NUM_OUTPUTS < MIN_TOKENS
    NUM_OUTPUTS = 6  # output tokens so far; advanced on the device by Sampler.record


NEUTRAL_FLOATS = (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)


def neutral_ints(vocab_size: int) -> tuple[int, ...]:
    return (1, vocab_size, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class RowParams:
    """One step's parameters per row: [N] column views of the gathered tables."""

    floats: torch.Tensor  # float32 [N, len(FloatCol)]
    ints: torch.Tensor  # int64 [N, len(IntCol)]

    def f(self, col: FloatCol) -> torch.Tensor:
        return self.floats[:, col]

    def i(self, col: IntCol) -> torch.Tensor:
        return self.ints[:, col]


class SlotTable:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.num_slots = num_slots
        self.neutral_ints = neutral_ints(vocab_size)
        self.floats = torch.tensor([NEUTRAL_FLOATS], dtype=torch.float32).repeat(num_slots, 1).to(device)
        self.ints = torch.tensor([self.neutral_ints], dtype=torch.int64).repeat(num_slots, 1).to(device)
        self._pending: dict[int, tuple[tuple[float, ...], tuple[int, ...]]] = {}  # slot -> row; last write wins

    def write(self, slot: int, floats: tuple[float, ...], ints: tuple[int, ...]) -> None:
        assert len(floats) == len(FloatCol) and len(ints) == len(IntCol)
        self._pending[slot] = (floats, ints)

    def flush(self) -> None:
        if not self._pending:
            return
        slots = list(self._pending)
        floats = torch.tensor([self._pending[s][0] for s in slots], dtype=torch.float32)
        # The slot index travels in column 0 of the int rows: one copy for both.
        ints = torch.tensor([(s, *self._pending[s][1]) for s in slots], dtype=torch.int64)
        self._pending.clear()
        ints = upload(ints, self.device)
        index = ints[:, 0]
        self.floats.index_copy_(0, index, upload(floats, self.device))
        self.ints.index_copy_(0, index, ints[:, 1:])

    def gather(self, slots: torch.Tensor) -> RowParams:
        return RowParams(self.floats.index_select(0, slots), self.ints.index_select(0, slots))

    def column(self, col: IntCol, slots: torch.Tensor) -> torch.Tensor:
        return self.ints[:, col].index_select(0, slots)

    def count_outputs(self, slots: torch.Tensor) -> None:
        """NUM_OUTPUTS += 1 for each row (a slot listed twice, like the scratch slot, counts twice)."""
        flat = slots * len(IntCol) + IntCol.NUM_OUTPUTS
        self.ints.view(-1).index_add_(0, flat, torch.ones_like(slots))
