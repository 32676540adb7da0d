"""Triton kernel: INT4 W4A16 GEMM for 64+ rows with the operands swapped: out^T = W x^T, so the
weight tile, dequantized in registers, is the tensor cores' A operand (which Hopper's wgmma reads
from registers; a B operand goes through shared memory) and each weight is dequantized once per
BLOCK_M rows of x (up to 256: once for a whole decode batch of 256).

Weights in the kernel layout (`int4_packing.Int4Weights`, words [K/8, N] or the panels of
`to_panels`): a [BLOCK_K / 8, BLOCK_N] tile of words is read transposed as [BLOCK_N, BLOCK_K / 8],
its nibbles spread by a reshape into [BLOCK_N, BLOCK_K] (input channels in order, so x^T's tile
is contiguous), dequantized as (16 + q) s - (16 + z) s (the nibble into 16.0's mantissa: no
int-to-float conversion) and rounded to the activation dtype. A K tile sits in one group.

Torch reference: `int4_packing.dequantize` then a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_int4_stream import word_offsets


@triton.jit(do_not_specialize=["M"])
def _int4_swap_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, s_xm, s_qk, s_sg, s_om,
                      GROUP: tl.constexpr, PANEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # the row tiles of one weight tile run together: it is read from HBM once
    pid_n = pid // tiles_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # loaded [BLOCK_K / 8, BLOCK_N] (16-byte vectors along N), transposed in registers
        words = tl.trans(tl.load(qw_ptr + word_offsets(k0 // 8 + offs_r, offs_n, s_qk, K, PANEL),
                                 mask=n_mask[None, :], other=0))
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zs = (16.0 + tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)) * s
        bits = (((words[:, :, None] >> shifts[None, None, :]) & 0xF) << 19) | 0x41800000
        q = tl.reshape(bits, (BLOCK_N, BLOCK_K)).to(tl.float32, bitcast=True)
        w = (q * s[:, None] - zs[:, None]).to(dt)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * s_xm + offs_k[:, None], mask=m_mask[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    out = out_ptr + offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def int4_swap_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, block_n: int = 64, block_m: int = 256, block_k: int = 64, warps: int = 8,
                   stages: int = 3) -> torch.Tensor:
    """x [M, K] @ dequantized W^T -> [M, N] in x's dtype (no act-order); qweight: words [K/8, N]
    or panels [N / P, K/8, P]."""
    m, k = x.shape
    panel = qweight.shape[2] if qweight.dim() == 3 else 0
    n = qweight.shape[0] * panel if panel else qweight.shape[1]
    group = k if group_size == -1 else group_size
    if k % group or group % block_k or block_k % 8:
        raise ValueError(f"int4 swapped GEMM: BLOCK_K {block_k} must be a multiple of 8 dividing the group size "
                         f"{group}, which must divide K {k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int4_swap_kernel[grid](x, qweight, scales, zeros, out, m, n, k, x.stride(0), qweight.stride(0) if not panel else 0,
                            scales.stride(0), out.stride(0), GROUP=group, PANEL=panel, BLOCK_N=block_n,
                            BLOCK_M=block_m, BLOCK_K=block_k,
                            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            num_warps=warps, num_stages=stages)
    return out
