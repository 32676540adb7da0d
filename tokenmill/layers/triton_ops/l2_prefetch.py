"""Triton helper: ask the GPU's L2 to fetch a range of memory, without waiting for it.

At batch 1 a decode step is a chain of weight reads, and HBM idles wherever the chain does
something else (attention over a short context, a norm, a kernel boundary). A kernel that runs
just before such a gap may issue prefetches for the next weight it knows of: the bytes stream
into L2 during the gap and the next kernel reads them from there. The instructions are fire and
forget: the issuing program does not wait for the data, and the data is constant (weights), so
the ordering rules of `pdl` are untouched (a prefetch reads no memory another kernel writes).

Program `prog` of `nprog` covers its share of the range in units of:
- MODE 1: 128-byte lines, `prefetch.global.L2::evict_last` (sm_80+);
- MODE 2: 128-byte lines, `prefetch.global.L2` (no eviction priority);
- MODE 3: 4096-byte chunks, `cp.async.bulk.prefetch.L2.global` (sm_90+).
The range is `nbytes` from `addr` (an integer address); `nbytes` a multiple of 4096.

CUDA only: the interpreter has no inline assembly (callers never turn it on for CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

MODES = {1: 128, 2: 128, 3: 4096}  # mode -> bytes per instruction


@triton.jit
def _issue(a, mask, MODE: tl.constexpr):
    if MODE == 3:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 4096; mov.b32 $0, 0; }",
            "=r,l,r", [a, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [a, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [a, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(addr, nbytes, prog, nprog, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share of [addr, addr + nbytes) into L2 (see the module docstring)."""
    UNIT: tl.constexpr = 4096 if MODE == 3 else 128
    units = nbytes // UNIT
    per = tl.cdiv(units, nprog)
    lo = prog * per
    hi = tl.minimum(lo + per, units)
    for u0 in range(lo, hi, BLOCK):
        offs = u0 + tl.arange(0, BLOCK)
        _issue(addr + offs.to(tl.int64) * UNIT, offs < hi, MODE)
