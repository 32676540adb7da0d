"""Admission control and draining: how many sequences this server lets into the engine.

A request is admitted with all its sequences (n per prompt) or refused with 503, so the
engine's queue stays bounded: at most `max_num_seqs + max_queued_requests` sequences.
While draining (after SIGTERM/SIGINT) every new request is refused; `abort_all` ends
whatever is still in flight when the grace period is over.
"""

from __future__ import annotations

import asyncio

from tokenmill.entrypoints.openai.errors import APIError


class Ticket:
    def __init__(self, admission: "Admission", request_ids: list[str], num_seqs: int) -> None:
        self._admission = admission
        self.request_ids = request_ids
        self.num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class Admission:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.draining = False
        self._num_seqs = 0
        self._tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    def admit(self, request_ids: list[str], num_seqs: int) -> Ticket:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self._num_seqs + num_seqs > self.capacity:
            raise APIError(503, f"the server is at capacity ({self.capacity} sequences admitted or queued); "
                                f"retry later", code="overloaded", headers={"retry-after": "1"})
        ticket = Ticket(self, request_ids, num_seqs)
        self._tickets.add(ticket)
        self._num_seqs += num_seqs
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        self._num_seqs -= ticket.num_seqs
        if not self._tickets:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every admitted request finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def in_flight_request_ids(self) -> list[str]:
        return [rid for ticket in self._tickets for rid in ticket.request_ids]
