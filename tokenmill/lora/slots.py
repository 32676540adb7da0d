"""The engine core's table of LoRA device slots: which adapter each of `max_loras` slots holds,
how many running requests use it, and which idle slot to give up first (least recently used).

Invariants: a slot used by a running request is never reassigned, so a step never holds more
distinct adapters than slots; a slot is (re)filled only by a `LoRALoad` sent with the step that
first needs it, and the workers apply the loads of a step before running it, after every
earlier step (so a step in flight never sees its adapter replaced).
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.protocol import LoRALoad, LoRARef


class LoRASlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.held: list[LoRARef | None] = [None] * num_slots  # the adapter in each slot
        self.users = [0] * num_slots  # running requests per slot
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # LRU first
        self.num_loads = 0

    def acquire(self, lora: LoRARef, loads: list[LoRALoad]) -> int | None:
        """The slot of `lora` for one more running request; appends a load to `loads` when the
        adapter must be put there. None: every slot is in use by other adapters."""
        slot = self.slot_of.get(lora.id)
        if slot is None:
            if not self.idle:
                return None
            slot = next(iter(self.idle))  # an empty slot, else the least recently used
            old = self.held[slot]
            if old is not None:
                del self.slot_of[old.id]
            self.held[slot] = lora
            self.slot_of[lora.id] = slot
            loads.append(LoRALoad(slot, lora))
            self.num_loads += 1
        self.idle.pop(slot, None)
        self.users[slot] += 1
        return slot

    def can_acquire(self, lora: LoRARef) -> bool:
        return lora.id in self.slot_of or bool(self.idle)

    def release(self, lora: LoRARef) -> None:
        """A running request of `lora` finished or was preempted."""
        slot = self.slot_of[lora.id]
        self.users[slot] -= 1
        assert self.users[slot] >= 0
        if not self.users[slot]:
            self.idle[slot] = None  # most recently used: given up last

    @property
    def num_active(self) -> int:
        return sum(1 for n in self.users if n)
