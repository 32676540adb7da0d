"""Short per-slot (token id, value) lists on the device: logit_bias, and the ids min_tokens bans.

Stored as padded [slots, W] tables (ids int64, values float32) that a step applies to its float32
logits with one gather each and one `scatter_add_`. Padding entries are (id 0, value 0.0): adding
0.0 is exact, and a request lists each id at most once, so the atomic adds on the device give the
same result in any order. Allocated when the first request uses them; W doubles as needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.layers.sampling.upload import upload


class SlotTokenLists:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.ids: torch.Tensor | None = None  # int64 [slots, W]
        self.values: torch.Tensor | None = None  # float32 [slots, W]
        self._pending: dict[int, tuple[Sequence[int], Sequence[float]]] = {}
        self._nonempty: set[int] = set()  # slots whose device row (or pending write) is not all padding

    @property
    def width(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def write(self, slot: int, ids: Sequence[int], values: Sequence[float]) -> None:
        """Queue the slot's list; an empty list clears a row only if it holds something."""
        assert len(ids) == len(values) and len(set(ids)) == len(ids)
        if ids or slot in self._nonempty:
            self._pending[slot] = (ids, values)
        if ids:
            self._nonempty.add(slot)
        else:
            self._nonempty.discard(slot)

    def flush(self) -> None:
        if not self._pending:
            return
        self._reserve(max(len(ids) for ids, _ in self._pending.values()))
        slots = list(self._pending)
        width = self.width
        ids = torch.zeros(len(slots), 1 + width, dtype=torch.int64)
        values = torch.zeros(len(slots), width, dtype=torch.float32)
        for row, slot in enumerate(slots):  # O(pending entries), not per step
            slot_ids, slot_values = self._pending[slot]
            ids[row, 0] = slot
            ids[row, 1:1 + len(slot_ids)] = torch.tensor(slot_ids, dtype=torch.int64)
            values[row, :len(slot_values)] = torch.tensor(slot_values, dtype=torch.float32)
        self._pending.clear()
        ids = upload(ids, self.device)
        index = ids[:, 0]  # the slot index rides in column 0
        assert self.ids is not None and self.values is not None
        self.ids.index_copy_(0, index, ids[:, 1:])
        self.values.index_copy_(0, index, upload(values, self.device))

    def _reserve(self, width: int) -> None:
        if width <= self.width:
            return
        new_width = max(1, self.width)
        while new_width < width:
            new_width *= 2
        ids = torch.zeros(self.num_slots, new_width, dtype=torch.int64, device=self.device)
        values = torch.zeros(self.num_slots, new_width, dtype=torch.float32, device=self.device)
        if self.ids is not None and self.values is not None:
            ids[:, :self.width] = self.ids
            values[:, :self.width] = self.values
        self.ids, self.values = ids, values

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids int64 [N, W], values float32 [N, W] of each row's slot."""
        assert self.ids is not None and self.values is not None, "gather before any list was flushed"
        return self.ids.index_select(0, slots), self.values.index_select(0, slots)
