"""Grammar token masks (structured outputs) applied to logits on the device, before sampling.

The mask is XGrammar's layout: int32 [n, ceil(V / 32)], bit t % 32 of word t // 32 set when token t
is allowed. It is unpacked a byte at a time (little-endian words: byte b of word w holds tokens
32w + 8b .. 32w + 8b + 7), so the temporary is one byte per token of the masked rows.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [n, vocab_size]: which tokens each row of `bitmask` (int32 [n, words]) allows."""
    n = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [n, words * 4], little-endian
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(n, -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever row i of `bitmask` clears bit t. `rows` (int64 [n],
    distinct) index `logits` ([N, V], any float dtype); the other rows are left as they are."""
    if not len(rows):
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0]:  # every row masked (rows: a permutation): in place, no logits copy
        ordered = torch.empty_like(allowed)
        ordered[rows] = allowed
        logits.masked_fill_(~ordered, float("-inf"))
        return
    picked = logits.index_select(0, rows)
    picked.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, picked)
