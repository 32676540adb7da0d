"""Pipeline device tokens: each step's sampled tokens go from the last stage to the first on the
devices, so that a micro-batch's next step need not wait for them to cross the host.

Without them, the first stage runs a row's next step only once the scheduler knows its token: the
token is read back on the last stage, replied to the core, applied, scheduled and sent, and the
first stage idles for that turn-around whenever it has no other micro-batch. With them, the
scheduler may schedule a row on its token in flight (a placeholder, `pp_input_tokens` -1) and the
first stage takes the token from the last stage's send, stream-ordered, no host sync:

  last stage   after sampling step j: the sampled ids of j's sampling rows (in batch order), sent
               on its own communicator (`ParallelContext.token_group`; not the activations', whose
               sends run the other way and would queue behind these);
  first stage  notes each launched step's sampling rows; before a step k with `pp_tokens_upto >=
               j` it posts the receive of j's ids on the compute stream, which waits for it and
               writes them into `next_token` of j's sampling rows, where a one-process sampler
               would have put them. Host-known tokens are written after (`apply_input_tokens`), so
               a placeholder row alone keeps the device's. The receive is posted just in time: one
               posted at j's launch ran (NCCL's receive kernel polling) beside the next step's
               compute until the last stage sent, and slowed the first stage's prompt steps by ~6%
               on H200s. A step's tokens not needed yet stay with the sender until a later step
               asks for them (every step's tokens are received, in order; the rest at shutdown).

Both stages compute the same sampling rows (a row samples when its step reaches the end of the
tokens the worker knows: both mirrors know the same), so every send has its receive, in order.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

MAX_TOKEN_SENDS = 16  # sends not known complete that the last stage keeps; past it, the oldest is waited for


class DeviceTokens:
    def __init__(self, group, first_rank: int, last_rank: int, is_first: bool, device: torch.device) -> None:
        self.group = group
        self.first_rank, self.last_rank = first_rank, last_rank
        self.is_first = is_first
        self.device = device
        self._expected: deque[tuple[int, np.ndarray]] = deque()  # first stage: (step, its sampling slots)
        self._sends: deque[tuple[object, torch.Tensor]] = deque()  # last stage

    @staticmethod
    def sampling_slots(num_computed: np.ndarray, num_known: np.ndarray, slots: np.ndarray,
                       counts: np.ndarray) -> np.ndarray:
        """The slots of a step's rows that sample (before the step: `num_computed` not yet advanced)."""
        return slots[num_computed[slots] + counts >= num_known[slots]]

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(slots.astype(np.int64))
        if self.device.type == "cuda":  # from pinned memory: a pageable copy would wait for the stream
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    # ------------------------------------------------------------------ last stage

    def send(self, next_token: torch.Tensor, sample_slots: np.ndarray) -> None:
        """Send the tokens just sampled into `next_token` for `sample_slots` (stream-ordered after
        the sampling); returns at once."""
        while self._sends and (len(self._sends) >= MAX_TOKEN_SENDS or self._sends[0][0].is_completed()):
            self._sends.popleft()[0].wait()
        if not len(sample_slots):
            return
        index = self._index(sample_slots)
        tokens = next_token.index_select(0, index)
        self._sends.append((dist.isend(tokens, dst=self.first_rank, group=self.group), tokens))

    # ------------------------------------------------------------------ first stage

    def expect(self, step_id: int, sample_slots: np.ndarray) -> None:
        """Step `step_id` was launched: its sampling rows' tokens will come (received by `apply`)."""
        if len(sample_slots):
            self._expected.append((step_id, sample_slots))

    def apply(self, upto: int, next_token: torch.Tensor) -> None:
        """Receive the tokens of every step up to `upto` and write them into `next_token`, on the
        compute stream (which waits for them; the host does not, on CUDA)."""
        while self._expected and self._expected[0][0] <= upto:
            _, slots = self._expected.popleft()
            buffer = torch.empty(len(slots), dtype=torch.int64, device=self.device)
            work = dist.irecv(buffer, src=self.last_rank, group=self.group)
            work.wait()
            next_token.index_copy_(0, self._index(slots), buffer)

    def drain(self) -> None:
        """Receive (and drop) every step's tokens not asked for yet: at shutdown, so that no send
        of the last stage is left without its receive (NCCL's teardown waits for its kernels)."""
        while self._expected:
            _, slots = self._expected.popleft()
            buffer = torch.empty(len(slots), dtype=torch.int64, device=self.device)
            dist.irecv(buffer, src=self.last_rank, group=self.group).wait()
