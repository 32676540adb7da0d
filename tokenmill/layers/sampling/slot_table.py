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
    NUM_OUTPUTS = 6  # output tokens so far; advanced on the device by Sampler.record / advance


@dataclass(frozen=True)
class SlotRow:
    """One slot's parameters, by name; the defaults are the neutral (scratch) row."""

    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    greedy: bool = True
    top_k: int = 0  # 0 = off (stored as the vocab size)
    seeded: bool = False
    seed_key: int = 0
    uses_penalties: bool = False
    min_tokens: int = 0
    num_outputs: int = 0

    def floats(self) -> tuple[float, ...]:
        by_col = {FloatCol.TEMPERATURE: self.temperature, FloatCol.TOP_P: self.top_p, FloatCol.MIN_P: self.min_p,
                  FloatCol.REPETITION: self.repetition, FloatCol.FREQUENCY: self.frequency,
                  FloatCol.PRESENCE: self.presence}
        return tuple(by_col[col] for col in FloatCol)

    def ints(self, vocab_size: int) -> tuple[int, ...]:
        by_col = {IntCol.GREEDY: int(self.greedy), IntCol.TOP_K: self.top_k or vocab_size,
                  IntCol.SEEDED: int(self.seeded), IntCol.SEED_KEY: self.seed_key,
                  IntCol.USES_PENALTIES: int(self.uses_penalties), IntCol.MIN_TOKENS: self.min_tokens,
                  IntCol.NUM_OUTPUTS: self.num_outputs}
        return tuple(by_col[col] for col in IntCol)


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
        self.vocab_size = vocab_size
        neutral = SlotRow()
        self.floats = torch.tensor([neutral.floats()], dtype=torch.float32).repeat(num_slots, 1).to(device)
        self.ints = torch.tensor([neutral.ints(vocab_size)], dtype=torch.int64).repeat(num_slots, 1).to(device)
        self._pending: dict[int, SlotRow] = {}  # last write wins

    def write(self, slot: int, row: SlotRow) -> None:
        self._pending[slot] = row

    def flush(self) -> None:
        if not self._pending:
            return
        slots = list(self._pending)
        floats = torch.tensor([self._pending[s].floats() for s in slots], dtype=torch.float32)
        # The slot index travels in column 0 of the int rows: one copy for both.
        ints = torch.tensor([(s, *self._pending[s].ints(self.vocab_size)) for s in slots], dtype=torch.int64)
        self._pending.clear()
        ints = upload(ints, self.device)
        index = ints[:, 0]
        self.floats.index_copy_(0, index, upload(floats, self.device))
        self.ints.index_copy_(0, index, ints[:, 1:])

    def gather(self, slots: torch.Tensor) -> RowParams:
        return RowParams(self.floats.index_select(0, slots), self.ints.index_select(0, slots))

    def column(self, col: IntCol, slots: torch.Tensor) -> torch.Tensor:
        return self.ints[:, col].index_select(0, slots)

    def count_outputs(self, slots: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """NUM_OUTPUTS += counts[i] (int64 [N], None = ones) for each row (a slot listed twice, like
        the scratch slot, counts twice)."""
        flat = slots * len(IntCol) + IntCol.NUM_OUTPUTS
        self.ints.view(-1).index_add_(0, flat, torch.ones_like(slots) if counts is None else counts)
