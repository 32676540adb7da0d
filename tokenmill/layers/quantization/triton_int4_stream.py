"""Triton kernel: INT4 W4A16 GEMM (x @ W^T) for every batch size, without act-order.

Weights in the kernel layout of `int4_packing.Int4Weights` (GPTQ, AWQ and compressed-tensors
all land there at load): `qweight` int32 [K/8, N] (input channel 8r + i in bits 4i of row r, N
contiguous: 16-byte vector loads along N), `scales` / `zeros` [G, N] (zero points are integers).
A K tile sits in one group, so the group's scale and zero are one row per step. Codes become
floats without int-to-float conversions (`_code_bits`: the nibble ORed into the mantissa of 16.0
gives 16 + q exactly), so the unpacking costs a shift and a logic op per weight.
- BLOCK_M == 1 (decode, one row): each word's 8 nibbles meet 8 strided slices of x on CUDA
  cores, one FMA per weight on 16 + q in float32, the zero point (16 + z) times x's sums once per
  tile and column; a [BLOCK_K/8, BLOCK_N] accumulator summed once at the end.
- 16 <= BLOCK_M < 64: `tl.dot` (tensor cores, float32 accumulation) on 16 + q in the activation
  dtype, and  sum_k x_k (q_kn - z_n) = sum_k x_k (16 + q_kn) - (16 + z_n) sum_k x_k  per tile
  (the conversion is the cost that matters at few rows: none here).
- BLOCK_M >= 64: the weight tile is dequantized in registers, (16 + q) s - (16 + z) s rounded
  to the activation dtype (as dequantize + GEMM rounds it), into one accumulator (a second
  one per group would not fit the registers of a 128 x 128 tile).
Tensor-core paths take the nibbles either to strided slices of x in 8 dots (NIBBLE_DOTS) or
spread them into a [BLOCK_K, BLOCK_N] tile by a reshape.
Small batches split K over programs to fill the SMs (`triton_split_k.store_tile`). Tiles per
rows bucket: `stream_tiles.int4_tiles`. Act-order weights (g_idx) take `triton_int4.int4_gemm`.

Torch reference: `int4_packing.dequantize` then a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization import stream_tiles
from tokenmill.layers.quantization.triton_split_k import store_tile


@triton.jit
def _code_bits(words, shift, MANT: tl.constexpr, MAGIC: tl.constexpr, HALF: tl.constexpr):
    """The bits of the float 16 + q for the 4-bit codes q at bits `shift` of each word (to be
    bitcast): no int-to-float conversion (quarter-rate on the GPU), q goes into the top 4
    mantissa bits of 16.0 (MAGIC, MANT mantissa bits): 16 * (1 + q / 16) exactly."""
    bits = (((words >> shift) & 0xF) << (MANT - 4)) | MAGIC
    if HALF:
        bits = bits.to(tl.int16)
    return bits


@triton.jit
def word_offsets(rows, offs_n, s_qk, K, PANEL: tl.constexpr):
    """Offsets of the words [rows, offs_n]: words [K/8, N] (PANEL 0), or the panels [N / PANEL, K/8,
    PANEL] of `int4_packing.to_panels`."""
    if PANEL == 0:
        return rows[:, None].to(tl.int64) * s_qk + offs_n[None, :]
    return ((offs_n // PANEL).to(tl.int64) * ((K // 8) * PANEL))[None, :] + rows[:, None] * PANEL + \
        (offs_n % PANEL)[None, :]


@triton.jit(do_not_specialize=["M"])
def _int4_stream_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NIBBLE_DOTS: tl.constexpr, MANT: tl.constexpr, MAGIC: tl.constexpr, HALF: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, PANEL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # programs sharing a weight tile run together: it is read from HBM once
    pid_n = pid // tiles_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_r = tl.arange(0, BLOCK_K // 8)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    dt = x_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)  # summed over rows once, at the end
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rows = k0 // 8 + offs_r
        words = tl.load(qw_ptr + word_offsets(rows, offs_n, s_qk, K, PANEL),
                        mask=(rows < K // 8)[:, None] & n_mask[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z16 = 16.0 + tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if BLOCK_M == 1:  # float32 FMAs on 16 + q (exact); the zero point leaves through x's sums
            d2 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
            xs = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
            for i in tl.static_range(8):
                # no mask: BLOCK_K divides the group, which divides K
                xi = tl.load(x_ptr + offs_m * s_xm + k0 + offs_r * 8 + i).to(tl.float32)
                d2 += _code_bits(words, 4 * i, 23, 0x41800000, False).to(tl.float32, bitcast=True) * xi[:, None]
                xs += xi
            acc2 += (d2 - xs[:, None] * z16[None, :]) * s[None, :]
        elif BLOCK_M >= 64:  # large tiles: dequantize in registers, (16 + q) s - (16 + z) s, one accumulator
            zs = z16 * s
            if NIBBLE_DOTS:
                for i in tl.static_range(8):
                    cols = k0 + offs_r * 8 + i
                    xi = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
                    q = _code_bits(words, 4 * i, 23, 0x41800000, False).to(tl.float32, bitcast=True)
                    acc = tl.dot(xi, (q * s[None, :] - zs[None, :]).to(dt), acc, input_precision=DOT_PRECISION)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                shifts = tl.arange(0, 8) * 4
                bits = _code_bits(words[:, None, :], shifts[None, :, None], 23, 0x41800000, False)
                q = tl.reshape(bits, (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True)
                acc = tl.dot(x, (q * s[None, :] - zs[None, :]).to(dt), acc, input_precision=DOT_PRECISION)
        else:  # small tiles: tensor cores on 16 + q; the offset and the zero point leave through x's row sums
            xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
            if NIBBLE_DOTS:  # nibble i of every word meets columns 8r + i of x: 8 dots, no reshape
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for i in tl.static_range(8):
                    cols = k0 + offs_r * 8 + i
                    xi = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
                    q = _code_bits(words, 4 * i, MANT, MAGIC, HALF).to(dt, bitcast=True)
                    part = tl.dot(xi, q, part, input_precision=DOT_PRECISION)
                    xsum += tl.sum(xi.to(tl.float32), axis=1)
            else:  # the words' nibbles spread over [BLOCK_K, BLOCK_N] by a reshape: one dot
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                shifts = tl.arange(0, 8) * 4
                bits = _code_bits(words[:, None, :], shifts[None, :, None], MANT, MAGIC, HALF)
                q = tl.reshape(bits, (BLOCK_K, BLOCK_N)).to(dt, bitcast=True)
                part = tl.dot(x, q, input_precision=DOT_PRECISION)
                xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += (part - xsum[:, None] * z16[None, :]) * s[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=0)[None, :]
    store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, pid_n * tiles_m + pid_m, pid_k, split,
               SPLIT_K)


# (mantissa bits, the bits of 16.0, 16-bit) per activation dtype, for `_code_bits`
_MAGIC = {torch.bfloat16: (7, 0x4180, True), torch.float16: (10, 0x4C00, True), torch.float32: (23, 0x41800000, False)}


def int4_stream_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, counters: torch.Tensor | None = None,
                     tiles: stream_tiles.Tiles | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized W^T [K, N] -> [M, N] in x's dtype (no act-order).
    counters: a zeroed int32 tensor (`stream_tiles.SplitCounters`); without it (or too small) the
    kernel runs without split-K. qweight: words [K/8, N], or panels [N / P, K/8, P] (`to_panels`)."""
    m, k = x.shape
    panel = qweight.shape[2] if qweight.dim() == 3 else 0
    n = qweight.shape[0] * panel if panel else qweight.shape[1]
    group = k if group_size == -1 else group_size
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    t = tiles or stream_tiles.int4_tiles(m, n, k, group, stream_tiles.sm_count(x.device))
    if k % group or group % t.block_k or t.block_k % 8:
        raise ValueError(f"int4 GEMM: BLOCK_K {t.block_k} must be a multiple of 8 dividing the group size {group}, "
                         f"which must divide K {k}")
    if x.dtype not in _MAGIC:
        raise ValueError(f"int4 GEMM: activations in {x.dtype}; supported: bfloat16, float16, float32")
    mant, magic, half = _MAGIC[x.dtype]
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    split = t.split if counters is not None and tiles_mn <= counters.numel() else 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _int4_stream_kernel[(tiles_mn, split)](
        x, qweight, scales, zeros, out, part, counters if split > 1 else out,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        NIBBLE_DOTS=t.nibble_dots and t.block_k >= 128, MANT=mant, MAGIC=magic, HALF=half,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SPLIT_K=split > 1, PANEL=panel, num_warps=t.warps, num_stages=t.stages)
    return out
