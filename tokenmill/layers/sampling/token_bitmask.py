"""Grammar token masks (structured outputs) applied to logits on the device, before sampling.

The mask is XGrammar's layout: int32 [n, ceil(V / 32)], bit t % 32 of word t // 32 set when token t
is allowed. It is unpacked a byte at a time (little-endian words: byte b of word w holds tokens
32w + 8b .. 32w + 8b + 7), so the temporary is one byte per token of the masked rows.

`apply_bitmask_by_row` is the worker's form: one mask row index per logits row (-1: unmasked), no
host sync, so it also runs inside the greedy step-end CUDA graph; on CUDA it is one Triton kernel
(`triton_ops/token_bitmask.py`), elsewhere `apply_bitmask_reference`.
"""

from __future__ import annotations

import torch

from tokenmill.layers import triton_ops


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [n, vocab_size]: which tokens each row of `bitmask` (int32 [n, words]) allows."""
    n = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [n, words * 4], little-endian
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(n, -1)[:, :vocab_size].bool()


def apply_bitmask_reference(logits: torch.Tensor, bits: torch.Tensor, which: torch.Tensor) -> None:
    """In place: logits[r, t] = -inf wherever bits[which[r]] clears bit t; rows with which[r] < 0
    are left alone. `bits` int32 [D, words], `which` int32/int64 [N]. Sync-free torch."""
    if not logits.shape[0] or not bits.shape[0]:
        return
    allowed = unpack_bitmask(bits.index_select(0, which.clamp(min=0).to(torch.int64)), logits.shape[1])
    allowed |= (which < 0)[:, None]
    logits.masked_fill_(~allowed, float("-inf"))


def apply_bitmask_by_row(logits: torch.Tensor, bits: torch.Tensor, which: torch.Tensor) -> None:
    """`apply_bitmask_reference`, as one Triton kernel on CUDA."""
    if triton_ops.enabled(logits):
        from tokenmill.layers.triton_ops.token_bitmask import apply_bitmask
        apply_bitmask(logits, bits, which)
    else:
        apply_bitmask_reference(logits, bits, which)
