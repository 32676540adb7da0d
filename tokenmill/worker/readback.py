"""Sampled ids (and logprobs) to the host without stalling the device.

On CUDA each step's results are copied into pinned host buffers on a side stream that waits
only for the step's sampling: the compute stream goes straight on with the next step, and
`ReadbackTicket.wait()` blocks only on that copy. Buffers are reused round-robin; a buffer is
taken again only after its previous copy was waited for (the engine never keeps more than a
few steps in flight). On CPU the tensors are the host arrays already.
"""

from __future__ import annotations

import torch

_RING = 8  # a step takes one ticket, two with constrained rows' drafts (structured outputs)


class ReadbackTicket:
    def __init__(self, tensors: list[torch.Tensor], event) -> None:
        self.tensors = tensors  # host tensors, valid after wait()
        self._event = event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensors


class Readback:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._buffers: list[dict[tuple, torch.Tensor]] = [{} for _ in range(_RING)]
        self._tickets: list[ReadbackTicket | None] = [None] * _RING
        self._next = 0

    def start(self, tensors: list[torch.Tensor]) -> ReadbackTicket:
        if not self._cuda:
            return ReadbackTicket(tensors, None)
        index = self._next
        self._next = (index + 1) % _RING
        previous = self._tickets[index]
        if previous is not None:
            previous.wait()
        buffers = self._buffers[index]
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)
        hosts = []
        with torch.cuda.stream(self._stream):
            for i, tensor in enumerate(tensors):
                key = (i, tensor.dtype)
                host = buffers.get(key)
                if host is None or host.numel() < tensor.numel():
                    host = buffers[key] = torch.empty(max(tensor.numel(), 256), dtype=tensor.dtype,
                                                      pin_memory=True)
                view = host[:tensor.numel()].view(tensor.shape)
                view.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # its memory stays ours until the copy ran
                hosts.append(view)
            event = torch.cuda.Event()
            event.record(self._stream)
        ticket = self._tickets[index] = ReadbackTicket(hosts, event)
        return ticket
