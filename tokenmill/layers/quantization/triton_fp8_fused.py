"""Triton kernels: the per-token fp8 quantization of an FP8 W8A8 linear's input, fused into the
kernel that produces that input (RMSNorm with its residual add; SiLU-and-mul).

The producer writes its usual output (bf16 / fp16) and, in the same pass, the fp8 codes and
one float32 scale per row of that output, computed from the rounded output exactly as
`triton_fp8.quantize_row_groups` would (amax / 448, at least 1e-12; x / scale saturated at
+-448): the W8A8 GEMM then skips its quantization launch and the re-read of its input.
The codes travel with the output tensor (`fp8_ops.attach` / `fp8_ops.attached`), so nothing between the
producer and the linear changes; any other consumer sees the plain output.

- `rms_norm_quant`: `triton_ops.rms_norm`'s numerics (residual add in the residual's dtype,
  float32 mean of squares, rounded twice), one or more whole rows per program;
- `silu_and_mul_quant`: `triton_ops.silu_and_mul`'s numerics, one row per program in two passes
  over column chunks (the second recomputes the product: bit-identical, read from L2).

Torch references: the unfused kernels followed by `fp8_ops.quantize_rows`.
Requires triton at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.fp8_ops import FP8_MAX, attach

TILE_ELEMENTS = 2048
MAX_ROWS = 64
SILU_CHUNK = 1024  # columns per step of the SiLU-and-mul row loops
SILU_STAGES = 3


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, num_rows, inv_n, eps, s_x, s_res,
                           N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           QMAX: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    row_ok = rows < num_rows
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + (rows * s_x)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + (rows * s_res)[:, None] + cols[None, :]
        summed = (x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) * inv_n
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(mean_sq + eps)
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    out = (normed * w[None, :]).to(dtype)
    tl.store(out_ptr + (rows * N)[:, None] + cols[None, :], out, mask=mask)
    o = out.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(o), axis=1) / QMAX, 1e-12)
    q = tl.minimum(tl.maximum(o / scale[:, None], -QMAX), QMAX)
    tl.store(q_ptr + (rows * N)[:, None] + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, code_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """RMSNorm of x [T, n] (after `residual += x` in place when given, as `fused_add_rms_norm`):
    a new [T, n] tensor in `out_dtype` with its fp8 codes and row scales attached."""
    t, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    q = torch.empty((t, n), dtype=code_dtype, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        rows = min(max(TILE_ELEMENTS // block, 1), MAX_ROWS)
        _rms_norm_quant_kernel[(triton.cdiv(t, rows),)](
            x, x if residual is None else residual, weight, out, q, s, t, 1.0 / n, eps, x.stride(0),
            0 if residual is None else residual.stride(0), N=n, BLOCK=block, ROWS=rows,
            HAS_RESIDUAL=residual is not None, QMAX=FP8_MAX, num_warps=min(max(block * rows // 256, 1), 16))
    return attach(out, q, s)


@triton.jit(do_not_specialize=["D"])
def _silu_and_mul_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, s_x, D, CHUNK: tl.constexpr, QMAX: tl.constexpr,
                               STAGES: tl.constexpr):
    """One row per program; both loops software-pipelined (`num_stages`: Triton pipelines a
    dot-free loop only then), so a program keeps several chunks' loads in flight."""
    dtype = x_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in tl.range(0, D, CHUNK, num_stages=STAGES):
        cols = c0 + offs
        mask = cols < D
        gate = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * s_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (silu * up).to(dtype)
        tl.store(out_ptr + t * D + cols, out, mask=mask)
        amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / QMAX, 1e-12)
    for c0 in tl.range(0, D, CHUNK, num_stages=STAGES):
        cols = c0 + offs
        mask = cols < D
        gate = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * s_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        o = (silu * up).to(dtype).to(tl.float32)
        q = tl.minimum(tl.maximum(o / scale, -QMAX), QMAX)
        tl.store(q_ptr + t * D + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t, scale)


def silu_and_mul_quant(x: torch.Tensor, code_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """[T, 2 * d] -> [T, d]: silu(gate) * up, with its fp8 codes and row scales attached."""
    t, two_d = x.shape
    d = two_d // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    q = torch.empty((t, d), dtype=code_dtype, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t and d:
        chunk = min(SILU_CHUNK, triton.next_power_of_2(d))
        _silu_and_mul_quant_kernel[(t,)](x, out, q, s, x.stride(0), d, CHUNK=chunk, QMAX=FP8_MAX, STAGES=SILU_STAGES,
                                         num_warps=8 if chunk >= 2048 else 4)
    return attach(out, q, s)
