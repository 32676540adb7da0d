"""Triton kernels of FP8 W8A8: dynamic activation quantization and the block-wise GEMM.

- `quantize_row_groups`: one program per (row, group of columns) computes the group's absolute
  maximum, its scale (amax / 448) and the saturated fp8 codes; a group of the whole row is
  per-token quantization (for `torch._scaled_mm`), a group of 128 feeds the block GEMM.
- `block_fp8_gemm`: C = (A * a_scale) @ (B * b_scale)^T with A [M, K] fp8 and one scale per
  (row, K block), B [N, K] fp8 and one scale per (N block, K block) (DeepSeek-V3 / Qwen3 FP8).
  A program's K tiles never straddle a K block and its N tile sits in one N block, so each
  K step multiplies the tile product by one row of activation scales and one weight scale,
  accumulating in float32.

Torch references: `fp8_ops.quantize_row_groups` and `fp8_ops.block_mm_reference`. Under
TRITON_INTERPRET=1 (CPU tests) the same kernels run on float32 tensors holding fp8 values.

Requires triton at import; `fp8.py` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.fp8_ops import FP8_MAX
from tokenmill.layers.triton_ops import pdl


@triton.jit(do_not_specialize=["K"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, s_sm,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * s_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / QMAX, 1e-12)
    q = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
    tl.store(q_ptr + row * s_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_sm + g, scale)


@triton.jit(do_not_specialize=["K"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, s_sm, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                          QMAX: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Per-token quantization of one row in two passes over CHUNK-wide slices (CHUNK divides K: no
    masks, 16-byte loads): the absolute maximum, then the codes (the second pass reads x from L2).
    Both loops are software-pipelined (num_stages), so each program keeps several slices in flight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    xr = x_ptr + row * s_xm + offs
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in tl.range(0, K, CHUNK, num_stages=STAGES):
        amax = tl.maximum(amax, tl.abs(tl.load(xr + k0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / QMAX, 1e-12)
    qr = q_ptr + row * s_qm + offs
    for k0 in tl.range(0, K, CHUNK, num_stages=STAGES):
        x = tl.load(xr + k0).to(tl.float32)
        tl.store(qr + k0, tl.minimum(tl.maximum(x / scale, -QMAX), QMAX).to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + row * s_sm, scale)


def _row_chunk(k: int) -> int:
    """The widest power of two <= 2048 dividing K (0: none >= 256; the group kernel runs then)."""
    c = 2048
    while c >= 256 and k % c:
        c //= 2
    return c if c >= 256 else 0


# pipeline depth of the per-token quantization's loops
ROW_STAGES = 3


def quantize_row_groups(x: torch.Tensor, group: int, out_dtype: torch.dtype = torch.float8_e4m3fn
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] of out_dtype, float32 scales [M, ceil(K / group)]).
    A group of the whole row (per token, K a multiple of 256 on contiguous rows) takes the
    two-pass row kernel; other groups one program per (row, group)."""
    m, k = x.shape
    chunk = _row_chunk(k) if group == k and x.stride(1) == 1 else 0
    if chunk:
        q = torch.empty((m, k), dtype=out_dtype, device=x.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), CHUNK=chunk,
                                        STAGES=ROW_STAGES, QMAX=FP8_MAX, num_warps=4, **pdl.launch_kwargs(x.device))
        return q, s
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = triton.next_power_of_2(group)
    _quantize_groups_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                         GROUP=group, BLOCK=block, QMAX=FP8_MAX,
                                         num_warps=8 if block >= 4096 else 4)
    return q, s


@triton.jit(do_not_specialize=["M"])
def _block_fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr,
    M, N, K, s_am, s_asm, s_bn, s_bsn, s_cm,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    scale_row = (pid_n * BLOCK_N) // GROUP_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * s_bn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        kb = k0 // GROUP_K
        a_s = tl.load(as_ptr + offs_m.to(tl.int64) * s_asm + kb, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptr + scale_row * s_bsn + kb)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION) * a_s[:, None] * b_s
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] codes, a_scale [M, K / bk]; b [N, K] codes, b_scale [N / bn, K / bk] -> [M, N]."""
    m, k = a.shape
    n = b.shape[0]
    group_n, group_k = block
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64 if m <= 64 else 128
    block_n = min(128 if m > 64 else 64, group_n)
    block_k = min(128, group_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, out, m, n, k, a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0),
        out.stride(0), GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m == 128 else 4, num_stages=3)
    return out
