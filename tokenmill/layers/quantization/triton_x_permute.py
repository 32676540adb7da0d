"""Triton kernel: x [M, K] with each 64-input step's columns in the INT4 mma layout's fragment K
order (logical column 16 m + 8 a + 2 j + b holds input 16 j + 4 m + 2 a + b), the operand the
swapped Gluon INT4 GEMM (`gluon_int4_swap_gemm`) reads. One pass of 4-byte input pairs (b = 0, 1
stay together): gathered inside each row's 128-byte step, stored contiguous; torch's permute copy of the same view took 4.2 us at 256 x 4096 and
10.4 us at 256 x 14336 on an H200 (`scripts/gpu_int4_permute_cost.py`). Torch reference:
`gluon_int4_swap_gemm.permute_x`'s view permute (the CPU path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kperm_src(cols):
    """The input column that column `cols` holds in the fragment K order (the same map as
    `gluon_int4_swap_gemm.gather_columns`): the producers that write x in that order
    (`int4_kperm`: RMSNorm, SiLU-and-mul) read input src and store at cols."""
    p = (cols // 2) % 32  # pair 8 m + 4 a + j of the step -> input pair 8 j + 2 m + a
    return (cols // 64) * 64 + 2 * (8 * (p % 4) + 2 * (p // 8) + (p // 4) % 2) + cols % 2


@triton.jit
def kperm_dst(cols):
    """The column that input column `cols` is stored at in the fragment K order (`kperm_src`'s
    inverse: input 16 j + 4 m + 2 a + b of a step at 16 m + 8 a + 2 j + b), for producers that
    compute values in input order (the attention kernels' output rows)."""
    c = cols % 64
    return (cols // 64) * 64 + 16 * ((c // 4) % 4) + 8 * ((c // 2) % 2) + 2 * (c // 16) + c % 2


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count
def _permute_kernel(x_ptr, out_ptr, M, K, s_xm, s_om, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # output pairs
    p = q % 32  # pair 8 m + 4 a + j of the step -> input pair 8 j + 2 m + a
    src = (q // 32) * 64 + 2 * (8 * (p % 4) + 2 * (p // 8) + (p // 4) % 2)
    b = tl.arange(0, 2)
    r64 = rows[:, None, None].to(tl.int64)
    mask = (rows[:, None, None] < M) & (q[None, :, None] * 2 < K)
    v = tl.load(x_ptr + r64 * s_xm + src[None, :, None] + b[None, None, :], mask=mask)  # 4-byte pairs
    tl.store(out_ptr + r64 * s_om + q[None, :, None] * 2 + b[None, None, :], v, mask=mask)


def permute_x_triton(x: torch.Tensor, block_r: int = 8, block_k: int = 512) -> torch.Tensor:
    """x [M, K] (K a multiple of 64, unit column stride) -> a new contiguous [M, K] in the fragment K order."""
    m, k = x.shape
    if k % 64 or x.stride(1) != 1:
        raise ValueError(f"x permute: K {k} must be a multiple of 64 with contiguous columns")
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m:
        _permute_kernel[(triton.cdiv(m, block_r), triton.cdiv(k, block_k))](
            x, out, m, k, x.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out
