"""Triton kernel: a tensor-parallel rank's embedding lookup over its vocab rows, in one launch.

`VocabParallelEmbedding` on one of several ranks embeds only the tokens in its rows [start,
start + rows) and zeros the rest (the all-reduce after it fills them in): in torch that is a
subtraction, two comparisons, an or, a masked fill of the ids, the gather and a masked fill of
the output, about six small launches per step that one GPU does not have. Here one program per
(token, column block) reads the token's id and copies its row, or writes zeros. Bit for bit the
torch path (a copy, no arithmetic).

Requires triton at import; `tokenmill.layers.parallel_linear` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 2048  # columns per program, at most


@triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
def _vocab_embedding_kernel(ids_ptr, w_ptr, out_ptr, start, num_rows, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < D
    local = tl.load(ids_ptr + t).to(tl.int64) - start
    inside = (local >= 0) & (local < num_rows)
    row = tl.where(inside, local, 0)
    x = tl.load(w_ptr + row * D + cols, mask=col_ok, other=0.0)  # (row 0 for a token of another rank)
    tl.store(out_ptr + t * D + cols, tl.where(inside, x, tl.zeros_like(x)), mask=col_ok)


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """[T] token ids -> [T, D]: weight[id - start] where 0 <= id - start < weight rows, else zeros.
    `weight`: [rows, D] contiguous."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [rows, D] tensor, got {tuple(weight.shape)}")
    ids = ids.reshape(-1)
    d = weight.shape[1]
    out = torch.empty(ids.shape[0], d, dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(d), MAX_BLOCK)
    _vocab_embedding_kernel[(ids.shape[0], triton.cdiv(d, block))](
        ids, weight, out, start, weight.shape[0], D=d, BLOCK=block, num_warps=4)
    return out
