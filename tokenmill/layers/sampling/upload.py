"""Host -> device copies of staged writes, asynchronous on CUDA."""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of a freshly built host tensor that the caller will not touch again.

    On CUDA the tensor is staged in pinned memory and copied with non_blocking=True: the host does
    not wait, and torch's pinned allocator keeps the staging block alive until the copy has run.
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
