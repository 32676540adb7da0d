"""The worker's running requests in fixed slots, mirrored on the device.

Each request the scheduler sends holds a slot in [0, max_slots) until it finishes or is
preempted; slot `max_slots` is scratch, for padded rows. Per slot:
- host (numpy, indexed by slot): tokens known on the host (the prompt, plus outputs from
  before a preemption), their count, the computed-token count, the block table;
- device: the block table, the computed-token count and the next input token. The sampler
  writes each sampled id straight into `next_token`, so a decode row never waits for the host
  to learn its input (async scheduling needs no placeholder bookkeeping).

Invariants: `num_computed[s]` is how many of slot s's tokens have KV in the cache once every
launched step has run, identical on host and device after each step; a row whose
`num_computed >= num_known` is a decode row: its input token is `next_token[s]` on the device.
Diffs become queued writes applied by `flush()` in a few copies; a steady decode step queues none.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.protocol import NewRequestData, unpack_ids
from tokenmill.sampling_params import SamplingParams


class PersistentBatch:
    def __init__(self, max_slots: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.scratch = max_slots
        self.device = device
        n = max_slots + 1
        self.slot_of: dict[int, int] = {}  # handle -> slot
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.tokens: list[list[int] | None] = [None] * n  # host-known tokens per slot
        self.params: list[SamplingParams | None] = [None] * n
        self.handle_of = np.full(n, -1, dtype=np.int64)  # slot -> handle (-1: free)
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.prompt_logprobs_from = np.zeros(n, dtype=np.int64)  # see NewRequestData
        self.num_known = np.zeros(n, dtype=np.int64)
        self.num_computed = np.zeros(n, dtype=np.int64)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.block_table = np.zeros((n, max_blocks_per_seq), dtype=np.int32)
        self.block_table_dev = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.num_computed_dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.num_blocks_dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.next_token_dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._block_writes: list[tuple[int, int, np.ndarray]] = []  # (slot, first column, ids)
        self.num_prompt_logprobs = 0  # requests held that want prompt logprobs

    # ------------------------------------------------------------------ membership

    def add(self, data: NewRequestData) -> int:
        if not self._free:
            raise RuntimeError(f"no free slot for request {data.handle}: all {self.max_slots} are taken")
        slot = self._free.pop()
        self.slot_of[data.handle] = slot
        self.handle_of[slot] = data.handle
        tokens = unpack_ids(data.token_ids)
        self.tokens[slot] = tokens
        self.params[slot] = data.sampling_params
        self.num_prompt_logprobs += data.sampling_params.prompt_logprobs is not None
        self.num_prompt[slot] = data.num_prompt_tokens
        self.prompt_logprobs_from[slot] = data.prompt_logprobs_from
        self.num_known[slot] = len(tokens)
        self.num_computed[slot] = data.num_computed_tokens
        self.num_blocks[slot] = 0
        self.append_blocks(slot, np.frombuffer(data.block_ids, dtype="<i4"))
        return slot

    def remove(self, handle: int) -> int | None:
        """Frees the handle's slot; returns it (None if the handle holds none)."""
        slot = self.slot_of.pop(handle, None)
        if slot is not None:
            self.num_prompt_logprobs -= self.params[slot].prompt_logprobs is not None
            self.tokens[slot] = None
            self.params[slot] = None
            self.handle_of[slot] = -1
            self._free.append(slot)
        return slot

    def append_blocks(self, slot: int, ids: np.ndarray) -> None:
        first = int(self.num_blocks[slot])
        if first + len(ids) > self.block_table.shape[1]:
            raise RuntimeError(f"slot {slot}: {first + len(ids)} blocks exceed max_model_len's "
                               f"{self.block_table.shape[1]}")
        self.block_table[slot, first:first + len(ids)] = ids
        self.num_blocks[slot] = first + len(ids)
        if len(ids):
            self._block_writes.append((slot, first, np.asarray(ids, dtype=np.int32)))

    def flush(self) -> None:
        """Apply queued block-table writes on the device: one scatter for all of them."""
        if not self._block_writes:
            return
        rows = np.concatenate([np.full(len(ids), slot, dtype=np.int64) for slot, _, ids in self._block_writes])
        cols = np.concatenate([np.arange(first, first + len(ids), dtype=np.int64)
                               for _, first, ids in self._block_writes])
        vals = np.concatenate([ids for _, _, ids in self._block_writes])
        touched = np.unique(rows)
        self._block_writes.clear()
        self.num_blocks_dev[to_device(touched, self.device)] = to_device(self.num_blocks[touched], self.device)
        index = to_device(np.stack([rows, cols]), self.device)
        self.block_table_dev.index_put_((index[0], index[1]), to_device(vals, self.device))

    # ------------------------------------------------------------------ views

    def slots(self, handles: list[int]) -> np.ndarray:
        slot_of = self.slot_of
        return np.fromiter((slot_of[h] for h in handles), dtype=np.int64, count=len(handles))

    def all_decode(self, slots: np.ndarray) -> bool:
        """Whether every row's next input is the token sampled last (nothing from the host)."""
        return bool((self.num_computed[slots] >= self.num_known[slots]).all())


def copy_to_device(array: np.ndarray, dest: torch.Tensor) -> None:
    """A host array into an existing tensor of its shape (a graph's static input), from pinned
    memory without blocking on CUDA (torch's pinned allocator keeps the staging block alive
    until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    dest.copy_(host.pin_memory() if dest.is_cuda else host, non_blocking=True)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; from pinned memory without blocking on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def to_device_aligned(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int64 host arrays on `device` in one copy, as views that each start 16-byte
    aligned, as a fresh tensor would: Triton specializes kernels on pointer alignment, and a view
    whose alignment followed the token count would compile a second variant in the middle of
    serving."""
    padded = [len(p) + len(p) % 2 for p in parts]
    offsets = np.cumsum([0] + padded)
    flat = np.zeros(offsets[-1], dtype=np.int64)
    for part, start in zip(parts, offsets):
        flat[start:start + len(part)] = part
    packed = to_device(flat, device)
    return [packed[start:start + len(part)] for part, start in zip(parts, offsets)]
