"""The INT4 tensor-core GEMV's fold epilogues (`triton_int4_mma`'s NORM, RES, SQ, YW and RSTD; what
`int4_norm_fold` asks of it): a Llama layer's RMSNorms and residual adds done inside the GEMVs at
decode sizes (<= 8 rows).
- NORM (`_norm_rows`): a prologue, the RMSNorm of the CTA's K slice of the float32 stream into scratch;
- RES (`_add_into_stream`): in the split-K epilogue, the result added into the float32 stream, with
  SQ (partial sums of squares of the new rows, for the next norm) and YW (y = stream * the next
  norm's weight);
- RSTD (`_rows_rstd`): in the split-K epilogue of the GEMV of y, each row's result times rstd from
  those sums of squares.
Triton device functions only; the kernel that calls them, its launch checks and the tests' reference
are `triton_int4_mma`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _norm_rows(res_ptr, nw_ptr, xn_ptr, M, K, s_rm, s_xm, lo, hi, inv_n, eps, KB: tl.constexpr, sq_ptr, nparts,
               SQ: tl.constexpr):
    """NORM's prologue: the RMSNorm of the float32 stream's rows < M (`res_ptr`, rows s_rm apart),
    columns [lo, hi) (the CTA's K slice), into xn (its dtype, rows s_xm apart), with the numerics
    of `triton_ops.rms_norm` (the mean of squares over the whole row in float32, the row times
    rsqrt rounded, times the weight rounded). KB columns a pass (a 16-byte load a thread: few
    registers, so the GEMV keeps its occupancy): one pass over the row for the sum of squares,
    one over the slice. Every CTA of a slice writes the same values; each reads back only its
    own after the barrier (global writes of a CTA are visible to its threads). The stream is read
    past L1 (.cg): another kernel wrote it. SQ: the rows' sums of squares are the sums of the
    `nparts` partial sums (rows nparts apart) that the launch which last added into the stream
    wrote (RES with SQ), in their order: no pass over the row."""
    dt: tl.constexpr = xn_ptr.dtype.element_ty
    cols = tl.arange(0, KB)
    for r in range(M):
        row = res_ptr + r * s_rm
        if SQ:
            sq = tl.load(sq_ptr + r * nparts + cols, mask=cols < nparts, other=0.0, cache_modifier=".cg")
        else:
            sq = tl.zeros([KB], dtype=tl.float32)
            for c0 in range(0, K, KB):
                x = tl.load(row + c0 + cols, mask=c0 + cols < K, other=0.0, cache_modifier=".cg")
                sq += x * x
        rstd = tl.rsqrt(tl.sum(sq, axis=0) * inv_n + eps)
        for c0 in range(lo, hi, KB):
            own = c0 + cols < hi
            x = tl.load(row + c0 + cols, mask=own, other=0.0, cache_modifier=".cg")
            normed = (x * rstd).to(dt).to(tl.float32)
            w = tl.load(nw_ptr + c0 + cols, mask=own, other=0.0).to(tl.float32)
            tl.store(xn_ptr + r * s_xm + c0 + cols, (normed * w).to(dt), mask=own)
    tl.debug_barrier()


@triton.jit
def _rows_rstd(sq_ptr, nparts, M, inv_n, eps, KB: tl.constexpr):
    """RSTD: rows 0..7's rsqrt(mean of squares + eps) from their nparts partial sums (rows < M)."""
    rows = tl.arange(0, 8)
    pc = tl.arange(0, KB)
    sq = tl.load(sq_ptr + rows[:, None] * nparts + pc[None, :], mask=(rows[:, None] < M) & (pc[None, :] < nparts),
                 other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(sq, axis=1) * inv_n + eps)


@triton.jit
def _add_into_stream(total, rows, offs_n, mask, M, N, res_ptr, s_rm, sq_ptr, nparts, pid_n, y_ptr, nw_ptr,
                     act: tl.constexpr, SQ: tl.constexpr, YW: tl.constexpr):
    """RES, in the split-K epilogue of the CTA that sums a channel block's partials (`total`, float32
    [8 rows, the block's channels `offs_n`]): the stream += the result as the unfused path rounds it
    (to the activation dtype `act`, then added in float32). SQ: this block's share of the next norm's
    sums of squares (column pid_n of sq, rows nparts apart). YW: y = the new stream * the next norm's
    weight, rounded (for a GEMV that scales by rstd after: RSTD)."""
    dst = res_ptr + rows[:, None] * s_rm + offs_n[None, :]
    h = total.to(act).to(tl.float32) + tl.load(dst, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(dst, h, mask=mask)
    if SQ:
        tl.store(sq_ptr + rows * nparts + pid_n, tl.sum(h * h, axis=1), mask=rows < M)
    if YW:
        w = tl.load(nw_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], (h * w[None, :]).to(act), mask=mask)
