"""One step's plan for the running requests: how many tokens each row takes, blocks for the
rows that cross into a new block, prefix-cache registration of the blocks they fill, and
preemption (from the tail) when the pool is short.

The rule (the reference semantics): rows take min(uncomputed, budget left) tokens in priority
order; a request whose last token is already in flight takes none; a row's blocks are grown,
and then the blocks it fills registered, before the next row's; when the pool is short the
last running row is preempted, until the row fits or is itself the victim.

Cost: a row that is a one-token decode (T + P - C == 1, which every one-token update keeps)
with room in its blocks needs no planning for a while; `due_step` says from which step on
the row must be looked at again. A step plans only the due rows, with numpy, and visits in
Python only rows that get blocks or register one. When every row takes all it asks for
(the budget is not exceeded), order does not matter; otherwise every row is planned in order.

Pipeline parallelism (`no_placeholders`): the first stage cannot read a sampled token on its
device, so a row is never scheduled past the tokens it knows: a request whose sampled token
is in flight takes none (no decode while in flight), while a prompt whose earlier chunk is in
flight may take its next chunk. Every row is then planned every step (no due steps). With
device tokens (`placeholder_ok`, by slot) the rows it marks may take one placeholder: their
token goes from the last stage to the first on the devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.running_table import RunningTable


@dataclass
class NewBlocks:
    """Blocks a step appends to running requests' tables (the workers get them as CachedRequestData)."""

    handles: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # every handle's, in handle order


@dataclass
class Plan:
    slots: np.ndarray  # the scheduled running rows, in priority order
    counts: np.ndarray  # tokens each
    one_token_each: bool  # every running row is scheduled, with one token
    draft_slots: np.ndarray | None = None  # rows that verify drafts this step (None: none do)
    draft_counts: np.ndarray | None = None  # how many each
    preempted: list[int] = field(default_factory=list)  # handles, in preemption order
    new_blocks: NewBlocks = field(default_factory=NewBlocks)


def due_steps(step_id: int, computed: np.ndarray, ahead: np.ndarray, capacity: np.ndarray,
              next_full: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """From which step rows must be planned again, once step `step_id` is planned. `computed`,
    `ahead` (T + P), `capacity`, `next_full` and `limit` are the rows' values after it.

    A row with one token to go stays a one-token decode while it has room: no new block
    (C + 1 <= capacity), no block filling up (C + 1 < next_full) and not at its token limit
    (C + 1 < limit). Other rows are planned every step. (A step with such a row is never
    empty, so step ids stay in step with the plans.)"""
    room = np.minimum(capacity - computed, np.minimum(next_full, limit) - computed - 1)
    return step_id + 1 + np.maximum(room, 0) * (ahead - computed == 1)


class RunningPlanner:
    def __init__(self, table: RunningTable, kv: KVCacheManager, preempt: Callable[[int], None],
                 no_placeholders: bool = False) -> None:
        """`preempt(slot)` takes a running row out (its request goes back to the waiting queue)."""
        self.no_placeholders = no_placeholders
        # With no_placeholders: rows (by slot) that may take a placeholder all the same (pipeline
        # device tokens; set by the scheduler before each plan), or None.
        self.placeholder_ok: np.ndarray | None = None
        self.table = table
        self.kv = kv
        self.block_size = kv.block_size
        self._preempt = preempt
        self._ones = np.ones(0, np.int64)

    def plan(self, step_id: int, budget: int, drafts: np.ndarray | None = None) -> Plan:
        """Plan step `step_id` for the running rows and write it to the table (tokens computed,
        samples in flight, blocks, due steps); the waiting queue gets what budget is left.
        `drafts` (by slot, from SpecPolicy): draft tokens a decode row verifies on top of its
        one; they take budget and KV slots like any token, and count as computed until the
        step's update takes back the rejected ones."""
        t = self.table
        slots = t.order.copy()
        if self.no_placeholders:
            examined = np.arange(len(slots))
        else:
            due = t.due_step[slots] <= step_id
            if drafts is not None:
                due |= drafts[slots] > 0
            examined = due.nonzero()[0]
        if not len(examined) and len(slots) <= budget:  # nothing due: one token each, no block
            t.num_computed[slots] += 1
            t.num_pending[slots] += 1  # C + 1 == T + P: the step samples their next token
            return Plan(slots, self.ones(len(slots)), True)
        ex_slots = slots[examined]
        self._release_windows(ex_slots)
        known, computed = t.num_tokens[ex_slots], t.num_computed[ex_slots]
        ahead = known + t.num_pending[ex_slots]  # placeholders included
        limit = t.token_limit[ex_slots]
        uncomputed = (self._reach(ex_slots, known, ahead) - computed) * (ahead < limit)  # a last token in flight: no more
        if drafts is not None:
            uncomputed = uncomputed + drafts[ex_slots] * ((ahead - computed == 1) & (uncomputed > 0))
        if len(slots) - len(examined) + int(uncomputed.sum()) > budget:
            return self._plan_in_order(slots, step_id, budget, drafts)
        after = computed + uncomputed
        filled = np.minimum(after, known)  # tokens whose K/V this step completes
        capacity, next_full = t.block_capacity[ex_slots], t.next_full_block_at[ex_slots]
        num_blocks = (after - capacity + self.block_size - 1) // self.block_size * (after > capacity)
        registers = (filled >= next_full) & (uncomputed > 0)
        plan = Plan(slots, self.ones(len(slots)), False)
        if not self._serve_in_bulk(ex_slots, num_blocks, registers, filled, plan.new_blocks):
            num_new = plan.counts.copy()
            num_new[examined] = uncomputed
            attention = examined[(num_blocks > 0) | registers]
            num_rows = self._serve_one_by_one(slots, num_new, attention, plan)
            return self._apply(slots[:num_rows], num_new[:num_rows], step_id, plan)
        # Tokens the step may add: one when it samples, 1 + k when it also verifies k drafts.
        samples = np.maximum(after - ahead + 1, 0) * (uncomputed > 0)
        if drafts is not None:
            drafted = (after > ahead).nonzero()[0]
            plan.draft_slots, plan.draft_counts = ex_slots[drafted], (after - ahead)[drafted]
        t.num_computed[slots] += 1  # the examined rows are set right below
        t.num_pending[slots] += 1
        t.num_computed[ex_slots] = after
        t.num_pending[ex_slots] = ahead - known + samples
        t.due_step[ex_slots] = due_steps(step_id, after, ahead + samples, t.block_capacity[ex_slots],
                                         t.next_full_block_at[ex_slots], limit)
        if self.kv.window is not None:  # a chunk's blocks behind the window go back next step
            t.due_step[ex_slots[uncomputed > 1]] = step_id + 1
        if (uncomputed == 1).all():
            plan.one_token_each = True
            return plan
        plan.counts = plan.counts.copy()
        plan.counts[examined] = uncomputed
        if not uncomputed.all():
            scheduled = plan.counts > 0
            plan.slots, plan.counts = slots[scheduled], plan.counts[scheduled]
        return plan

    def _reach(self, slots: np.ndarray, known: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        """How far rows may be computed: placeholders included, unless they are not allowed."""
        if not self.no_placeholders:
            return ahead
        if self.placeholder_ok is None:
            return known
        # A row already on a placeholder (computed past `known`) that may not take another: none.
        return np.where(self.placeholder_ok[slots], ahead, np.maximum(known, self.table.num_computed[slots]))

    def set_due_steps(self, slots: np.ndarray, step_id: int) -> None:
        """`due_steps` for rows whose plan for `step_id` is in the table (e.g. just admitted)."""
        if len(slots):
            t = self.table
            t.due_step[slots] = due_steps(step_id, t.num_computed[slots], t.num_tokens[slots] + t.num_pending[slots],
                                          t.block_capacity[slots], t.next_full_block_at[slots], t.token_limit[slots])

    def ones(self, n: int) -> np.ndarray:
        """n ones (int64, shared: copy before writing)."""
        if len(self._ones) != n:
            self._ones = np.ones(n, np.int64)
        return self._ones

    # ------------------------------------------------------------------ every row, in order

    def _plan_in_order(self, slots: np.ndarray, step_id: int, budget: int, drafts: np.ndarray | None) -> Plan:
        """Plan every row: they take their tokens in priority order until the budget runs out."""
        t = self.table
        self._release_windows(slots)
        known = t.num_tokens[slots]
        ahead = known + t.num_pending[slots]
        computed = t.num_computed[slots]
        uncomputed = (self._reach(slots, known, ahead) - computed) * (ahead < t.token_limit[slots])
        if drafts is not None:
            uncomputed = uncomputed + drafts[slots] * ((ahead - computed == 1) & (uncomputed > 0))
        before = uncomputed.cumsum() - uncomputed
        num_new = np.minimum(uncomputed, np.maximum(budget - before, 0))
        after = computed + num_new
        capacity = t.block_capacity[slots]
        num_blocks = (after - capacity + self.block_size - 1) // self.block_size * (after > capacity)
        registers = (np.minimum(after, known) >= t.next_full_block_at[slots]) & (num_new > 0)
        plan = Plan(slots, num_new, False)
        num_rows = len(slots)
        attention = ((num_blocks > 0) | registers).nonzero()[0]
        if len(attention) and not self._serve_in_bulk(slots[attention], num_blocks[attention], registers[attention],
                                                      np.minimum(after, known)[attention], plan.new_blocks):
            num_rows = self._serve_one_by_one(slots, num_new, attention, plan)
        return self._apply(slots[:num_rows], num_new[:num_rows], step_id, plan)

    def _apply(self, slots: np.ndarray, num_new: np.ndarray, step_id: int, plan: Plan) -> Plan:
        """Write a plan's token counts to the table (tokens computed, samples in flight) and
        keep the scheduled rows."""
        t = self.table
        computed = t.num_computed[slots] + num_new
        t.num_computed[slots] = computed
        ahead = t.num_tokens[slots] + t.num_pending[slots]
        beyond = (computed - ahead) * (num_new > 0)  # >= 0: the row samples; > 0: it verifies drafts
        t.num_pending[slots] += np.maximum(beyond + 1, 0) * (num_new > 0)
        if (beyond > 0).any():
            drafted = (beyond > 0).nonzero()[0]
            plan.draft_slots, plan.draft_counts = slots[drafted], beyond[drafted]
        self.set_due_steps(slots, step_id)
        if self.kv.window is not None:  # a chunk's blocks behind the window go back next step
            t.due_step[slots[num_new > 1]] = step_id + 1
        scheduled = num_new > 0
        plan.slots, plan.counts = slots[scheduled], num_new[scheduled]
        return plan

    # ------------------------------------------------------------------ blocks

    def _serve_in_bulk(self, slots: np.ndarray, num_blocks: np.ndarray, registers: np.ndarray,
                       filled: np.ndarray, new_blocks: NewBlocks) -> bool:
        """Give rows their new blocks, then register the blocks they fill, without a Python call
        per block. When the pool has room for all the rows and no prefix-cache entry this step
        registers is also one its allocations evict, doing every allocation first and then
        every registration ends in the same state as doing them row by row. Otherwise (False)
        change nothing."""
        t, kv, bs = self.table, self.kv, self.block_size
        total = int(num_blocks.sum())
        if total > kv.pool.num_free:
            return False
        registering = registers.nonzero()[0]
        if total and len(registering):
            evicted = kv.pool.hashes_evicted_by(total)
            if evicted and any(not evicted.isdisjoint(kv.hashes_to_cache(
                    int(t.handle[slot]), num_tokens, t.tokens[slot], t.requests[slot].block_hashes))
                    for slot, num_tokens in zip(slots[registering].tolist(), filled[registering].tolist())):
                return False
        if total:
            taken = kv.pool.allocate(total)
            growing = num_blocks.nonzero()[0]
            handles, counts = t.handle[slots[growing]].tolist(), num_blocks[growing].tolist()
            kv.append_blocks(handles, counts, taken)
            new_blocks.handles.extend(handles)
            new_blocks.counts.extend(counts)
            new_blocks.block_ids.extend(taken)
            t.block_capacity[slots] += num_blocks * bs
        if len(registering):
            reg_slots, reg_filled = slots[registering], filled[registering]
            handles, chains = t.handle[reg_slots].tolist(), [t.requests[s].block_hashes for s in reg_slots.tolist()]
            first_token = t.next_full_block_at[reg_slots] - bs  # of the block each fills next
            if (reg_filled < first_token + 2 * bs).all():  # each fills one block: hash them together
                kv.cache_next_blocks(handles, t.tokens[reg_slots[:, None], first_token[:, None] + np.arange(bs)], chains)
            else:
                for slot, handle, num_tokens, chain in zip(reg_slots.tolist(), handles, reg_filled.tolist(), chains):
                    kv.cache_full_blocks(handle, num_tokens, t.tokens[slot], chain)
            t.next_full_block_at[reg_slots] = (reg_filled // bs + 1) * bs
        return True

    def _serve_one_by_one(self, slots: np.ndarray, num_new: np.ndarray, rows: np.ndarray, plan: Plan) -> int:
        """Serve `rows` (positions in `slots`, ascending) one at a time, preempting from the tail
        when the pool is short. Returns how many leading rows of `slots` still run."""
        num_rows = len(slots)
        for i in rows.tolist():
            if i >= num_rows:
                break
            slot, n = int(slots[i]), int(num_new[i])
            blocks = self._grow(slot, n)
            while blocks is None:
                victim = int(slots[num_rows - 1])
                plan.preempted.append(int(self.table.handle[victim]))
                self._preempt(victim)
                num_rows -= 1
                if victim == slot:
                    return num_rows
                blocks = self._grow(slot, n)
            if blocks:
                plan.new_blocks.handles.append(int(self.table.handle[slot]))
                plan.new_blocks.counts.append(len(blocks))
                plan.new_blocks.block_ids.extend(blocks)
        return num_rows

    def _release_windows(self, slots: np.ndarray) -> None:
        """Sliding windows (`kv.window`): the rows give back their blocks wholly behind the window
        of the first position they will still compute. That is at least min(computed, known):
        drafts in flight count as computed until rejected. A row is looked at whenever it grows
        a block and the step after a prompt chunk, so a decoding row holds at most
        ceil(window / block_size) + 1 blocks plus the one it grows into."""
        kv = self.kv
        if kv.window is None or not len(slots):
            return
        t = self.table
        first = np.minimum(t.num_computed[slots], t.num_tokens[slots])
        for handle, position in zip(t.handle[slots].tolist(), first.tolist()):
            kv.release_out_of_window(handle, position)

    def _grow(self, slot: int, num_new: int) -> list[int] | None:
        """Blocks for a row's next `num_new` tokens, and prefix-cache registration of the
        blocks they fill; None (nothing changed) when the pool is short."""
        t = self.table
        handle, computed = int(t.handle[slot]), int(t.num_computed[slot])
        blocks = self.kv.allocate(handle, computed, num_new)
        if blocks is None:
            return None
        if blocks:
            t.block_capacity[slot] += len(blocks) * self.block_size
        filled = min(computed + num_new, int(t.num_tokens[slot]))
        if filled >= t.next_full_block_at[slot]:
            request = t.requests[slot]
            assert request is not None
            num_cached = self.kv.cache_full_blocks(handle, filled, t.tokens[slot], request.block_hashes)
            t.next_full_block_at[slot] = (num_cached + 1) * self.block_size
        return blocks
