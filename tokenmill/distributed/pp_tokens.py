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
  first stage  after launching step j: a receive of as many ids, posted on a side stream (it
               holds back nothing); before a step k with `pp_tokens_upto >= j`: the compute stream
               waits for that receive and writes the ids into `next_token` of j's sampling rows,
               where a one-process sampler would have put them. Host-known tokens are written
               after (`apply_input_tokens`), so a placeholder row alone keeps the device's.

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
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._expected: deque[tuple[int, torch.Tensor, torch.Tensor, object]] = deque()  # first stage
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
        """Post the receive of step `step_id`'s tokens (after launching it); nothing waits for it yet."""
        if not len(sample_slots):
            return
        index = self._index(sample_slots)
        buffer = torch.empty(len(sample_slots), dtype=torch.int64, device=self.device)
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # the buffer and index exist
            with torch.cuda.stream(self._side):
                work = dist.irecv(buffer, src=self.last_rank, group=self.group)
        else:
            work = dist.irecv(buffer, src=self.last_rank, group=self.group)
        self._expected.append((step_id, index, buffer, work))

    def apply(self, upto: int, next_token: torch.Tensor) -> None:
        """Write the tokens of every step up to `upto` into `next_token` (the compute stream waits
        for their receives; the host does not, on CUDA)."""
        while self._expected and self._expected[0][0] <= upto:
            _, index, buffer, work = self._expected.popleft()
            work.wait()
            next_token.index_copy_(0, index, buffer)
