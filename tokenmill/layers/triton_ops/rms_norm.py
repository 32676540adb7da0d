"""Triton kernel: RMSNorm, alone or fused with the residual add before it.

One program normalizes ROWS rows, each held whole in registers (BLOCK >= hidden, a power of
two): one read of x (and of the residual), one write of the output (and of the new residual).
Short rows (q/k norm over a head) are packed several to a program, long ones take one each.

Numerics are those of `tokenmill.layers.norm.RMSNorm` (HF's), op for op:
- residual: x + residual in float32, stored in place in the residual's dtype (float32 for the
  model's stream: no rounding; the activation dtype rounds as HF's `residual + hidden_states`),
  and normalized as stored;
- mean of squares in float32, reciprocal square root in float32 (never rounded on its own);
- row times that, rounded to the output dtype; times the weight, rounded again.
They differ from the torch path only in summation order and rsqrt's last bit.
GEMMA (`layers.norm.GemmaRMSNorm`): the row times rstd times (1 + weight), all in float32,
rounded once at the end, as HF's Gemma norms do.

A row is (r // inner, r % inner) over two strides, so [T, heads, head_dim] views with gaps
between tokens (q or k inside the fused qkv output, for Qwen3's q/k norm) are read where they
sit, with no copy. The last axis must be contiguous; the output is a new contiguous tensor.

KPERM (2-D rows of a multiple of 64, `quantization.int4_kperm`): the output's columns in the INT4
swapped GEMM's K order (normalized input c stored at column `kperm_dst(c)`); everything else, the
residual included, in natural order.

Requires triton at import; `tokenmill.layers.norm` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_x_permute import kperm_dst
from tokenmill.layers.triton_ops import pdl

TILE_ELEMENTS = 2048  # elements per program at least: rows are packed until a tile holds this many
MAX_ROWS = 64


@triton.jit
def rms_norm_rows(x_ptr, res_ptr, w_ptr, x_rows, rows, cols, col_ok, mask, s_res, inv_n, eps, dtype: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    """The rows' RMSNorm in `dtype` (a [ROWS, BLOCK] tile), after `residual += x` stored in place
    when HAS_RESIDUAL; x's rows start at x_rows. Shared by this kernel and the fp8-quantizing
    one (`quantization.triton_fp8_fused`), so both keep one set of numerics."""
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + (rows * s_res)[:, None] + cols[None, :]
        summed = (x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) * inv_n
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GEMMA:
        out = (x * tl.rsqrt(mean_sq + eps)[:, None] * (1.0 + w[None, :])).to(dtype)
    else:
        rstd = tl.rsqrt(mean_sq + eps)
        normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
        out = (normed * w[None, :]).to(dtype)
    return out


# num_rows changes every step; inner is not specialized either, so q and k norms (32 and 8 heads,
# say) share one compiled kernel; a division per row is nothing next to the row's traffic.
@triton.jit(do_not_specialize=["num_rows", "inner"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    num_rows, inv_n, eps,
    inner,  # rows per outer index: heads of [T, heads, head_dim], 1 for 2-D x
    s_x_outer, s_x_inner,  # x strides of row r's (r // inner, r % inner); columns are contiguous
    s_res,  # residual row stride (2-D only)
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    KPERM: tl.constexpr = False,
):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x_rows = (rows // inner) * s_x_outer + (rows % inner) * s_x_inner
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    out = rms_norm_rows(x_ptr, res_ptr, w_ptr, x_rows, rows, cols, col_ok, mask, s_res, inv_n, eps, dtype,
                        HAS_RESIDUAL, GEMMA)
    # KPERM: only the output's store moves (input column c to `kperm_dst(c)`, a permutation inside each
    # 64 columns: the same mask); the reads and the residual stay contiguous (an H100 profile: permuted
    # reads cost 0.8 us a call)
    dst = kperm_dst(cols) if KPERM else cols
    tl.store(out_ptr + (rows * N)[:, None] + dst[None, :], out, mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype, gemma: bool = False, kperm: bool = False) -> torch.Tensor:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {n}")
    if kperm and (x.dim() != 2 or n % 64):
        raise ValueError(f"rms_norm kperm: 2-D rows of a multiple of 64 columns, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:  # [T, heads, head_dim], possibly with gaps between tokens
        num_rows, inner, s_outer, s_inner = x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        flat = x if x.dim() == 2 else x.reshape(-1, n)
        num_rows, inner, s_outer, s_inner = flat.shape[0], 1, flat.stride(0), 0
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    rows = min(max(TILE_ELEMENTS // block, 1), MAX_ROWS)
    num_warps = min(max(block * rows // 256, 1), 16)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, x if residual is None else residual, weight, out,
        num_rows, 1.0 / n, eps, inner, s_outer, s_inner, 0 if residual is None else residual.stride(0),
        N=n, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None, GEMMA=gemma, num_warps=num_warps,
        KPERM=kperm, **pdl.launch_kwargs(x.device),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             gemma: bool = False, kperm: bool = False) -> torch.Tensor:
    """RMSNorm over the last axis of x ([..., n]; 3-D views may be strided): a new tensor in
    `out_dtype` (default x's); kperm: its columns in the INT4 swapped GEMM's K order."""
    return _launch(x, None, weight, eps, out_dtype or x.dtype, gemma, kperm)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, gemma: bool = False, kperm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place (in the residual's dtype), then RMSNorm of it: (normed in x's dtype, residual).

    x, residual: [T, n]; residual's rows contiguous, its dtype x's or float32 (the model's stream).
    x is left as it was. kperm: the normed output's columns in the INT4 swapped GEMM's K order.
    """
    if (x.dim() != 2 or residual.shape != x.shape or residual.dtype not in (x.dtype, torch.float32)
            or residual.stride(-1) != 1):
        raise ValueError(f"fused_add_rms_norm needs x and residual of one [T, n] shape, the residual in x's "
                         f"dtype or float32, got {tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    return _launch(x, residual, weight, eps, x.dtype, gemma, kperm), residual
