"""A step's grammar masks (structured outputs) onto the device, overlapping the forward pass.

What goes over is one int32 block: each logits row's mask index (`which`, -1: unmasked) then the
step's distinct mask rows (16 KB each with a 128k vocabulary; rows in the same grammar state share
one). On CUDA it is written into a reused pinned buffer and copied on a side stream, which the
compute stream then waits for: the copy runs beside the forward pass, and the host never blocks
on it. The destination is either a fresh device tensor (eager sampling) or a `StaticMasks` block
that the greedy step-end CUDA graph reads (worker/greedy_tail.py). The pinned buffer is reused
only after the copy that read it is done (an event; in practice long done: a step's mask is made
from the tokens of the step before, which were read back after its own copy).
"""

from __future__ import annotations

import numpy as np
import torch


class StaticMasks:
    """A fixed device block the masked greedy step-end graph reads: `which` int32 [rows] then
    `bits` int32 [rows, words] (at most one distinct mask per logits row)."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.rows, self.words = rows, words
        self.flat = torch.full((rows * (1 + words),), -1, dtype=torch.int32, device=device)
        self.which = self.flat[:rows]
        self.bits = self.flat[rows:].view(rows, words)
        self.released = None  # CUDA event recorded after the last replay that read the block

    def release(self) -> None:
        """Call after the replay that reads the block is enqueued: the next copy waits for it."""
        if self.flat.is_cuda:
            self.released = torch.cuda.Event()
            self.released.record()


class MaskUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # pinned int32, flat
        self._copied = None  # CUDA event: the last copy out of `_host` is done
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, bits: np.ndarray, which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(bits int32 [distinct, words], which int32 [n]) on the device, ready for the compute
        stream: logits row r takes mask row which[r] (-1: none)."""
        n = len(which)
        block = self._staged(bits, which, n)
        if self._stream is None:
            device = block.clone()
        else:
            with torch.cuda.stream(self._stream):
                device = block.to(self.device, non_blocking=True)
            self._after_copy(device)
        return device[n:].view(bits.shape), device[:n]

    def into(self, static: StaticMasks, bits: np.ndarray, which: np.ndarray) -> None:
        """The same into `static` (which[:len(which)], bits[:distinct]), for a graph replay that
        follows on the compute stream."""
        assert len(which) <= static.rows and len(bits) <= static.rows and bits.shape[1] == static.words
        block = self._staged(bits, which, static.rows)
        if self._stream is None:
            static.flat[:block.numel()].copy_(block)
            return
        # Write after the replay that read `static` last (not after the whole compute stream: the
        # forward pass enqueued since runs beside the copy).
        if static.released is not None:
            self._stream.wait_event(static.released)
        with torch.cuda.stream(self._stream):
            static.flat[:block.numel()].copy_(block, non_blocking=True)
        self._after_copy(None)

    def _staged(self, bits: np.ndarray, which: np.ndarray, which_len: int) -> torch.Tensor:
        """[which, padded with -1 to which_len | bits] in the host buffer (pinned on CUDA)."""
        size = which_len + bits.size
        if self._host is None or self._host.numel() < size:
            grown = max(size, 2 * (0 if self._host is None else self._host.numel()))
            self._host = torch.empty(grown, dtype=torch.int32, pin_memory=self._stream is not None)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host.numpy()
        host[:len(which)] = which
        host[len(which):which_len] = -1
        host[which_len:size] = bits.reshape(-1)
        return self._host[:size]

    def _after_copy(self, device: torch.Tensor | None) -> None:
        compute = torch.cuda.current_stream(self.device)
        self._copied = torch.cuda.Event()
        self._copied.record(self._stream)
        compute.wait_stream(self._stream)
        if device is not None:
            device.record_stream(compute)
