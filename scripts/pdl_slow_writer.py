"""The slow PDL writer of the race checks on a GPU (`gpu_int4_b1.py`, `gpu_attn_prewait.py`): a kernel
that lets the next kernel (launched with PDL) start at once, spins, then writes its output, so that a
reader that does not wait for it reads what was there before (NaN in the checks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slow_copy_kernel(x_ptr, y_ptr, n, ITERS, BLOCK: tl.constexpr):
    """y = x after a spin of ITERS dependent FMAs, letting the next kernel (PDL) start at once."""
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    acc = x.to(tl.float32)
    for _ in range(ITERS):
        acc = acc * 0.999 + 0.001
    tl.store(y_ptr + offs, tl.where(acc < 3.0e38, x, 0.0), mask=offs < n)  # always x: the spin's result kept


def slow_write(src: torch.Tensor, dst: torch.Tensor, iters: int = 20000) -> None:
    """dst = src (both contiguous, as many elements), written after the spin."""
    _slow_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), iters, BLOCK=1024, num_warps=4)
