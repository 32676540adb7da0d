"""Triton kernel: INT4 W4A16 GEMM (x @ W^T) for every batch size, without act-order.

Weights in the kernel layout of `int4_packing.Int4Weights` (GPTQ, AWQ and compressed-tensors
all land there at load): `qweight` int32 [K/8, N] (input channel 8r + i in bits 4i of row r, N
contiguous: 16-byte vector loads along N), `scales` / `zeros` [G, N] (zero points are integers).
A K tile sits in one group, so the group's scale and zero are one row per step and
    sum_k x_k (q_kn - z_n) s_n = s_n * (sum_k x_k q_kn - z_n * sum_k x_k):
the codes q (0..15, exact in bf16) meet the activations unchanged, and the zero point and the
scale are applied once per tile and output column, not per weight element.
- BLOCK_M == 1 (decode, one row): each word's 8 nibbles meet 8 strided slices of x on CUDA
  cores; no reshape, float32 sums.
- BLOCK_M >= 16: the words are unpacked into a [BLOCK_K, BLOCK_N] tile (a reshape of
  [BLOCK_K/8, 8, BLOCK_N]) and multiplied with `tl.dot` (tensor cores), float32 accumulation.
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


@triton.jit(do_not_specialize=["M"])
def _int4_stream_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, s_xm, s_qk, s_sg, s_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_K // 8)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rows = k0 // 8 + offs_r
        words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * s_qk + offs_n[None, :],
                        mask=(rows < K // 8)[:, None] & n_mask[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            dot = tl.zeros([BLOCK_N], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + offs_m * s_xm + k0 + offs_r * 8 + i, mask=(k0 + offs_r * 8 + i) < K,
                             other=0.0).to(tl.float32)
                q = ((words >> (4 * i)) & 0xF).to(tl.float32)
                dot += tl.sum(q * xi[:, None], axis=0)
                xsum += xi
            part = (dot - z * tl.sum(xsum, axis=0))[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(x.dtype)
            xsum = tl.sum(x.to(tl.float32), axis=1)
            part = tl.dot(x, q, input_precision=DOT_PRECISION) - xsum[:, None] * z[None, :]
        acc += part * s[None, :]
    store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, pid_n * tiles_m + pid_m, pid_k, split)


def int4_stream_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, counters: torch.Tensor | None = None,
                     tiles: stream_tiles.Tiles | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized W^T [K, N] -> [M, N] in x's dtype (no act-order).
    counters: a zeroed int32 tensor (`stream_tiles.SplitCounters`); without it (or too small) the
    kernel runs without split-K."""
    m, k = x.shape
    n = qweight.shape[1]
    group = k if group_size == -1 else group_size
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    t = tiles or stream_tiles.int4_tiles(m, n, k, group, stream_tiles.sm_count(x.device))
    if group % t.block_k or t.block_k % 8:
        raise ValueError(f"int4 GEMM: BLOCK_K {t.block_k} must be a multiple of 8 dividing the group size {group}")
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    split = t.split if counters is not None and tiles_mn <= counters.numel() else 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _int4_stream_kernel[(tiles_mn, split)](
        x, qweight, scales, zeros, out, part, counters if split > 1 else out,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.warps, num_stages=t.stages)
    return out
