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
  first stage  after launching step j it notes j's sampling rows (`expect`). The receive of j's
               ids is posted when the next step k is launched, after k's forward pass and before
               k's activations are sent (`post_pending`), on a side stream that waits for that
               forward pass: it polls only once the stage's device has nothing else to run. Before
               a step with `pp_tokens_upto >= j` the compute stream waits for it and writes the ids
               into `next_token` of j's sampling rows, where a one-process sampler would have put
               them (posting the receive there if it was not posted yet). Host-known tokens are
               written after (`apply_input_tokens`), so a placeholder row alone keeps the device's.

Order of the point-to-point operations (the hang of e4c00ef). Both ranks must issue their sends
and receives, over both communicators, in one order that matches: NCCL may run the kernels of
two communicators one after the other, and then a receive issued on one rank after a send whose
match the other rank issued after its own send of the first one's match waits forever. The last
stage issues  recv act(j), send tok(j), recv act(j+1), ...; so the first stage issues  send
act(j), recv tok(j), send act(j+1), ... Posting each receive just before the step that needed it
(e4c00ef: send act(j+1) before recv tok(j)) crossed the two and hung on two H200s; posting it at
j's launch kept the order but polled beside the next step's compute (~6% slower prompt steps).
`p2p_order.py` logs the order on every rank and checks it (tests, under gloo).

Both stages compute the same sampling rows (a row samples when its step reaches the end of the
tokens the worker knows: both mirrors know the same), so every send has its receive, in order.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.distributed.p2p_order import P2POrderLog

MAX_TOKEN_SENDS = 16  # sends not known complete that the last stage keeps; past it, the oldest is waited for


class _Expected:
    """A launched step whose sampled tokens the first stage will receive."""

    __slots__ = ("step_id", "slots", "index", "buffer", "work")

    def __init__(self, step_id: int, slots: np.ndarray) -> None:
        self.step_id, self.slots = step_id, slots
        self.index = self.buffer = self.work = None  # set once its receive is posted


class DeviceTokens:
    def __init__(self, group, first_rank: int, last_rank: int, is_first: bool, device: torch.device,
                 order_log: P2POrderLog | None = None) -> None:
        self.group = group
        self.first_rank, self.last_rank = first_rank, last_rank
        self.is_first = is_first
        self.device = device
        self.order_log = order_log
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._expected: deque[_Expected] = deque()  # first stage, oldest first
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
        if self.order_log is not None:
            self.order_log.record(self.first_rank, "send", "tokens")
        self._sends.append((dist.isend(tokens, dst=self.first_rank, group=self.group), tokens))

    # ------------------------------------------------------------------ first stage

    def expect(self, step_id: int, sample_slots: np.ndarray) -> None:
        """Step `step_id` was launched and its activations sent: its sampling rows' tokens will
        come (the receive is posted by the next `post_pending` or `apply`)."""
        if len(sample_slots):
            self._expected.append(_Expected(step_id, sample_slots))

    def _post(self, entry: _Expected, side: bool) -> None:
        entry.index = self._index(entry.slots)
        entry.buffer = torch.empty(len(entry.slots), dtype=torch.int64, device=self.device)
        if self.order_log is not None:
            self.order_log.record(self.last_rank, "recv", "tokens")
        if side and self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # after the work enqueued so far
            with torch.cuda.stream(self._side):
                entry.work = dist.irecv(entry.buffer, src=self.last_rank, group=self.group)
        else:
            entry.work = dist.irecv(entry.buffer, src=self.last_rank, group=self.group)

    def post_pending(self) -> None:
        """Post the receives not posted yet (each launched step's, before the next step's
        activations go out: the order above), on the side stream."""
        for entry in self._expected:
            if entry.work is None:
                self._post(entry, side=True)

    def apply(self, upto: int, next_token: torch.Tensor) -> None:
        """Write the tokens of every step up to `upto` into `next_token` (the compute stream waits
        for their receives; the host does not, on CUDA)."""
        while self._expected and self._expected[0].step_id <= upto:
            entry = self._expected.popleft()
            if entry.work is None:  # needed before the next step: posted here, still in order
                self._post(entry, side=False)
            entry.work.wait()
            next_token.index_copy_(0, entry.index, entry.buffer)

    def drain(self) -> None:
        """At shutdown, both ends: every send matched and done before the groups go (the first
        stage posts the receives not posted yet; both wait for theirs). A peer that died leaves
        this waiting: the executor's stop then kills the process."""
        works = []
        if self.is_first:
            self.post_pending()
            works = [entry.work for entry in self._expected]
            self._expected.clear()
        else:
            works = [work for work, _ in self._sends]
        for work in works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._sends.clear()
