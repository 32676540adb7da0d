"""Triton kernel: silu(gate) * up over a fused [gate | up] projection, in one pass.

Grid (token, column block): each program reads BLOCK gate and BLOCK up values of one token
and writes BLOCK outputs. KPERM (d a multiple of 64, `quantization.int4_kperm`): product c is
stored at column `kperm_dst(c)`, the INT4 swapped GEMM's K order. Numerics are `tokenmill.layers.activation.SiluAndMul`'s: silu in
float32 rounded to the activation dtype (torch's F.silu), then the product rounded again.

Requires triton at import; `tokenmill.layers.activation` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_x_permute import kperm_dst
from tokenmill.layers.triton_ops import pdl

MAX_BLOCK = 1024  # output columns per program, at most
NUM_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, D: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                         PAIRED: tl.constexpr = False, KPERM: tl.constexpr = False):
    dtype = x_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    if PAIRED:  # `int4_packing.gate_up_pairs` order: in each 16 columns, 8 gates then their 8 ups
        g_cols = 16 * (cols // 8) + cols % 8
        gate = tl.load(x_ptr + t * s_x + g_cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * s_x + g_cols + 8, mask=mask, other=0.0).to(tl.float32)
    else:
        gate = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * s_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    dst = kperm_dst(cols) if KPERM else cols  # KPERM: only the store moves (the reads stay contiguous)
    tl.store(out_ptr + t * D + dst, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, paired: bool = False, kperm: bool = False) -> torch.Tensor:
    """[..., 2 * d] -> [..., d] (a new contiguous tensor): silu(x[..., :d]) * x[..., d:]; paired:
    x's columns in `int4_packing.gate_up_pairs` order (d a multiple of 8), the same product;
    kperm: the output's columns in the INT4 swapped GEMM's K order (d a multiple of 64)."""
    if x.shape[-1] % (16 if paired else 2):
        raise ValueError(f"silu_and_mul needs an even last axis (paired: a multiple of 16), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    if kperm and d % 64:
        raise ValueError(f"silu_and_mul kperm: d a multiple of 64, got {d}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if flat.shape[0] == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), MAX_BLOCK)
    _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(d, block))](
        flat, out, flat.stride(0), D=d, BLOCK=block, num_warps=NUM_WARPS, PAIRED=paired, KPERM=kperm,
        **pdl.launch_kwargs(x.device))
    return out
