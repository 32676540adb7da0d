"""Triton kernel: the per-token fp8 quantization of an FP8 W8A8 linear's input, fused into the
RMSNorm (with its residual add) that produces that input.

The producer writes its usual output (bf16 / fp16) and, in the same pass, the fp8 codes and
one float32 scale per row of that output, computed from the rounded output exactly as
`triton_fp8.quantize_row_groups` would (amax / 448, at least 1e-12; x / scale saturated at
+-448): the W8A8 GEMM then skips its quantization launch and the re-read of its input.
The codes travel with the output tensor (`fp8_ops.attach` / `fp8_ops.attached`), so nothing between the
producer and the linear changes; any other consumer sees the plain output.

`rms_norm_quant` has `triton_ops.rms_norm`'s numerics (residual add in the residual's dtype,
float32 mean of squares, rounded twice), one or more whole rows per program (the row is in
registers: its absolute maximum costs nothing more). An H200 (`gpu_quant.py --parts w8a8`):
4.2 us at 256 rows against 6.9 for the norm + quantization, 110 vs 138 at 8192.
SiLU-and-mul is not fused: with its 14336-wide rows (one per program, two passes over column
chunks) it ran 18.3 us at 256 rows against 9.7 for the two kernels, 359 vs 304 at 8192.

Torch reference: the unfused kernel followed by `fp8_ops.quantize_rows`.
Requires triton at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.fp8 import SILU_QUANT_MAX_COLS
from tokenmill.layers.quantization.fp8_ops import FP8_MAX, attach
from tokenmill.layers.triton_ops import pdl
from tokenmill.layers.triton_ops.rms_norm import rms_norm_rows

TILE_ELEMENTS = 2048
MAX_ROWS = 64


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, num_rows, inv_n, eps, s_x, s_res,
                           N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           QMAX: tl.constexpr, USE_PDL: tl.constexpr = False, WRITE_OUT: tl.constexpr = True):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    row_ok = rows < num_rows
    mask = row_ok[:, None] & col_ok[None, :]
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    out = rms_norm_rows(x_ptr, res_ptr, w_ptr, rows * s_x, rows, cols, col_ok, mask, s_res, inv_n, eps, dtype,
                        HAS_RESIDUAL, False)
    if WRITE_OUT:
        tl.store(out_ptr + (rows * N)[:, None] + cols[None, :], out, mask=mask)
    o = out.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(o), axis=1) / QMAX, 1e-12)
    q = tl.minimum(tl.maximum(o / scale[:, None], -QMAX), QMAX)
    tl.store(q_ptr + (rows * N)[:, None] + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, code_dtype: torch.dtype = torch.float8_e4m3fn,
                   write_out: bool = True) -> torch.Tensor:
    """RMSNorm of x [T, n] (after `residual += x` in place when given, as `fused_add_rms_norm`):
    a new [T, n] tensor in `out_dtype` with its fp8 codes and row scales attached. write_out=False:
    the tensor is left unwritten (only its codes hold the values; for a consumer that reads them alone)."""
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
            HAS_RESIDUAL=residual is not None, QMAX=FP8_MAX, num_warps=min(max(block * rows // 256, 1), 16),
            WRITE_OUT=write_out, **pdl.launch_kwargs(x.device))
    return attach(out, q, s)


# SiLU-and-mul + quantization: one program per row, the whole row in registers (the earlier
# version walked column chunks twice and lost to the two kernels). Rows of up to
# `fp8.SILU_QUANT_MAX_COLS` output columns take it; wider ones keep the two kernels.


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, num_rows, s_x, D: tl.constexpr, BLOCK: tl.constexpr,
                               QMAX: tl.constexpr, USE_PDL: tl.constexpr = False, WRITE_OUT: tl.constexpr = True):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # `silu_and_mul`'s roundings
    out = (silu * up).to(dtype)
    if WRITE_OUT:
        tl.store(out_ptr + row * D + cols, out, mask=mask)
    o = out.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(o), axis=0) / QMAX, 1e-12)
    q = tl.minimum(tl.maximum(o / scale, -QMAX), QMAX)
    tl.store(q_ptr + row * D + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul_quant(x: torch.Tensor, code_dtype: torch.dtype = torch.float8_e4m3fn,
                       write_out: bool = True) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [T, 2d] (`triton_ops.silu_and_mul`'s values): a new [T, d]
    tensor with its per-token fp8 codes and scales attached (write_out=False: left unwritten, as
    `rms_norm_quant`'s)."""
    t, two_d = x.shape
    d = two_d // 2
    if two_d % 2 or d > SILU_QUANT_MAX_COLS:
        raise ValueError(f"silu_and_mul_quant needs an even last axis of at most {2 * SILU_QUANT_MAX_COLS}, "
                         f"got {two_d}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    q = torch.empty((t, d), dtype=code_dtype, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = triton.next_power_of_2(d)
        _silu_and_mul_quant_kernel[(t,)](x, out, q, s, t, x.stride(0), D=d, BLOCK=block, QMAX=FP8_MAX,
                                         num_warps=min(max(block // 1024, 1), 16), WRITE_OUT=write_out,
                                         **pdl.launch_kwargs(x.device))
    return attach(out, q, s)
