"""Triton kernel: grammar token masks applied to logits in place, one launch for the whole step.

Grid (logits row, token block). Row r takes mask row which[r] of `bits` (int32 [D, ceil(V / 32)],
XGrammar's layout: bit t % 32 of word t // 32 allows token t) and sets -inf wherever that row
clears a bit; a row with which[r] < 0 is left alone (an unconstrained row: its programs load one
int and store nothing). No host sync and fixed shapes, so it runs inside a CUDA graph with
`bits` and `which` as static inputs. Torch reference: `token_bitmask.apply_bitmask_reference`.

Requires triton at import; `tokenmill.layers.sampling.token_bitmask` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # tokens per program
NUM_WARPS = 4


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bits_ptr, which_ptr, V, words, s_logits, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # The row's mask index, loaded per lane (one address: a broadcast read; a scalar load would
    # do, but the interpreter cannot mask with a scalar-and-block combination).
    mask_row = tl.load(which_ptr + row + tokens * 0).to(tl.int64)
    live = (tokens < V) & (mask_row >= 0)
    word = tl.load(bits_ptr + mask_row * words + tokens // 32, mask=live, other=-1)
    cleared = live & (((word >> (tokens % 32)) & 1) == 0)
    ninf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * s_logits + tokens, ninf, mask=cleared)


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor, which: torch.Tensor) -> None:
    """In place on `logits` [N, V] (unit stride along V): row r masked by bits[which[r]]; which int32 [N]."""
    n, vocab = logits.shape
    if n == 0:
        return
    assert logits.stride(1) == 1 and bits.is_contiguous() and which.shape[0] == n
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, BLOCK))](
        logits, bits, which, vocab, bits.shape[1], logits.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
