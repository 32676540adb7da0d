"""A step's grammar masks (structured outputs) onto the device, overlapping the forward pass.

The mask arrives while the device runs the step's forward pass. On CUDA its distinct rows are
copied into a reused pinned buffer and sent on a side stream, which the compute stream then waits
for: the copy (16 KB per distinct mask of a 128k vocabulary) runs beside the forward pass instead
of after it, and the host never blocks on it; each row's mask is then gathered on the device. The
buffer is reused only once the step that used it was read back (a step's mask is made from the
tokens of the step before), so no copy overwrites one still in flight.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.worker.persistent_batch import to_device


class MaskUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # pinned int32, flat
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, bits: np.ndarray, which: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks of `rows` (int64 [n], logits rows) on the device, ready for the compute stream:
        (int32 [n, words], rows). `bits` [distinct, words] holds each distinct mask once; row i
        takes bits[which[i]] (expanded on the device)."""
        index = to_device(np.concatenate([rows, which]).astype(np.int64), self.device)
        rows_device, which_device = index[:len(rows)], index[len(rows):]
        if self._stream is None:
            return torch.from_numpy(bits.copy()).index_select(0, which_device), rows_device
        size = bits.size
        if self._host is None or self._host.numel() < size:
            self._host = torch.empty(max(size, 2 * (0 if self._host is None else self._host.numel())),
                                     dtype=torch.int32, pin_memory=True)
        host = self._host[:size]
        host.numpy()[:] = bits.reshape(-1)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            device = host.to(self.device, non_blocking=True)
        compute.wait_stream(self._stream)
        device.record_stream(compute)
        return device.view(bits.shape).index_select(0, which_device), rows_device
