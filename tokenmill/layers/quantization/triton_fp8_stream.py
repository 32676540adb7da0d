"""Triton kernel: FP8-weight GEMM for small batches (decode), activations kept in bf16/fp16.

y = x @ (W * scale)^T with W [N, K] e4m3 and either one float32 scale per output channel
([N, 1]) or one per [bn, bk] tile ([ceil(N / bn), K / bk], DeepSeek-V3 / Qwen3 block FP8).
At a few rows the GEMM is bound by reading W, so there is nothing to gain from fp8 activations:
the activations are not quantized (no extra launch, and more accurate than W8A8: only the
weight is rounded). Each program streams a [BLOCK_N, BLOCK_K] tile of W per step (rows of K
contiguous: 16-byte vector loads), converts it in registers and accumulates in float32:
- BLOCK_M == 1 (one row): CUDA-core FMAs into a [BLOCK_N, BLOCK_K] float32 accumulator,
  summed over K at the end (channel scales; block scales sum each step);
- BLOCK_M >= 16: `tl.dot` on the tile converted to the activation dtype.
Block scales multiply each K step's product (a K tile sits in one K block, an N tile in one N
block); channel scales multiply the finished tile. Split-K and its one-launch reduction:
`triton_split_k.store_tile`. Tiles: `stream_tiles.fp8_tiles`.

Torch reference: `fp8_stream_reference` (below). Under TRITON_INTERPRET=1 the weight may be a
float32 tensor holding fp8 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization import stream_tiles
from tokenmill.layers.quantization.triton_split_k import store_tile
from tokenmill.layers.triton_ops import pdl


@triton.jit
def _k_part(acc, w, x, s_ptr, offs_n, n_mask, k0, s_sn, BLOCK_SCALES: tl.constexpr, GROUP_N: tl.constexpr,
            GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K step of the non-FLAT tiles: acc + the [BLOCK_N, BLOCK_K] tile w times the rows x."""
    if BLOCK_M == 1:
        part = tl.sum(_w_f32(w) * x.to(tl.float32), axis=1)[None, :]
    else:
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if BLOCK_SCALES:
        bs = tl.load(s_ptr + (offs_n // GROUP_N) * s_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
        return acc + part * bs[None, :]
    return acc + part


@triton.jit
def _w_f32(w):
    """A weight tile in float32. int8 (the 8-bit LM head, `lm_head_8bit`): through the float bits of
    2^23 + 128 + w (an integer add and a float subtract, both exact) instead of I2F, a conversion
    Hopper issues at a quarter of the FMA rate: at one row it would bound the head's GEMV."""
    if w.dtype == tl.int8:
        return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _load_x(x_rows, offs_k, mask, K, SILU_X: tl.constexpr):
    """The activation tile: x itself, or (SILU_X) silu(gate) * up of a [gate | up] row pair read
    where the gate half starts at column 0 and the up half at column K, rounded as
    `triton_ops.silu_and_mul` rounds (silu to x's dtype, then the product), so the fused call
    equals SiLU-and-mul followed by the GEMV."""
    if SILU_X:
        dtype = x_rows.dtype.element_ty
        gate = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (silu * up).to(dtype)
    return tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _fp8_stream_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, s_xm, s_wn, s_sn, s_om,
    FLAT: tl.constexpr,  # one row, channel scales: elementwise products, summed over K at the end
    BLOCK_SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr, PIPE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # `pdl`: the first weight tile is loaded before waiting for x's producer
    SILU_X: tl.constexpr = False,  # x is [M, 2K] (gate | up): the GEMV reads silu(gate) * up (`_load_x`)
    PRE: tl.constexpr = 1,  # weight tiles loaded before the PDL wait (1-4; more than 1: FLAT only)
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
    if FLAT:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * s_wn
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    # The first K step is peeled: its weight tile (constant data) is read before the wait, so
    # under PDL it streams while the kernel that writes x is still finishing.
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_hi
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    # PRE > 1 (one row): the next tiles too, so more of a small weight is in flight across the wait
    # (the previous kernels' tails); consumed in order after it, the same sums as PRE 1.
    if PRE >= 2:
        w1 = tl.load(w_rows + (offs_k + BLOCK_K)[None, :], mask=n_mask[:, None] & (offs_k + BLOCK_K < k_hi)[None, :],
                     other=0.0)
    if PRE >= 3:
        w2 = tl.load(w_rows + (offs_k + 2 * BLOCK_K)[None, :],
                     mask=n_mask[:, None] & (offs_k + 2 * BLOCK_K < k_hi)[None, :], other=0.0)
    if PRE >= 4:
        w3 = tl.load(w_rows + (offs_k + 3 * BLOCK_K)[None, :],
                     mask=n_mask[:, None] & (offs_k + 3 * BLOCK_K < k_hi)[None, :], other=0.0)
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    x = _load_x(x_rows, offs_k, m_mask[:, None] & k_mask[None, :], K, SILU_X)
    if FLAT:
        acc2 += _w_f32(w) * x.to(tl.float32)
        if PRE >= 2:
            acc2 += _w_f32(w1) * _load_x(x_rows, offs_k + BLOCK_K, (offs_k + BLOCK_K < k_hi)[None, :], K,
                                                SILU_X).to(tl.float32)
        if PRE >= 3:
            acc2 += _w_f32(w2) * _load_x(x_rows, offs_k + 2 * BLOCK_K, (offs_k + 2 * BLOCK_K < k_hi)[None, :],
                                                K, SILU_X).to(tl.float32)
        if PRE >= 4:
            acc2 += _w_f32(w3) * _load_x(x_rows, offs_k + 3 * BLOCK_K, (offs_k + 3 * BLOCK_K < k_hi)[None, :],
                                                K, SILU_X).to(tl.float32)
    else:
        acc = _k_part(acc, w, x, s_ptr, offs_n, n_mask, k_lo, s_sn, BLOCK_SCALES, GROUP_N, GROUP_K, BLOCK_M,
                      DOT_PRECISION)
    # PIPE > 1: the loop carries num_stages, so Triton pipelines its loads (cp.async) even without
    # a tl.dot (which it does not do otherwise): bytes in flight while a tile is converted.
    for k0 in tl.range(k_lo + PRE * BLOCK_K, k_hi, BLOCK_K, num_stages=PIPE):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = _load_x(x_rows, offs_k, m_mask[:, None] & k_mask[None, :], K, SILU_X)
        if FLAT:
            acc2 += _w_f32(w) * x.to(tl.float32)
        else:
            acc = _k_part(acc, w, x, s_ptr, offs_n, n_mask, k0, s_sn, BLOCK_SCALES, GROUP_N, GROUP_K, BLOCK_M,
                          DOT_PRECISION)
    if FLAT:
        acc = tl.sum(acc2, axis=1)[None, :]
    if not BLOCK_SCALES:
        acc *= tl.load(s_ptr + offs_n * s_sn, mask=n_mask, other=0.0)[None, :]
    store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, pid_n * tiles_m + pid_m, pid_k, split,
               SPLIT_K)


def fp8_stream_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None = None, counters: torch.Tensor | None = None,
                    tiles: stream_tiles.Tiles | None = None, silu_x: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (weight [N, K] fp8 * scale)^T -> [M, N] in x's dtype (or `out_dtype`).
    scale: [N, 1] per channel, or [ceil(N / bn), K / bk] with `block` = (bn, bk).
    counters: a zeroed int32 tensor (one per output tile, `stream_tiles.SplitCounters`); without
    it (or too small) the kernel runs without split-K.
    silu_x: x is [M, 2K], a [gate | up] projection's output, and the product is taken with
    silu(gate) * up (SiLU-and-mul done in the GEMV's loads: one launch less per MLP)."""
    m, k = x.shape
    n = weight.shape[0]
    if silu_x:
        if k != 2 * weight.shape[1]:
            raise ValueError(f"fp8 stream GEMM with silu_x: x has {k} columns, the weight {weight.shape[1]} "
                             f"(x must be [gate | up], twice the weight's)")
        k //= 2
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    t = tiles or stream_tiles.fp8_tiles(m, n, k, block, stream_tiles.sm_count(x.device))
    if block is not None and (block[0] % t.block_n or block[1] % t.block_k):
        raise ValueError(f"fp8 stream GEMM: tiles {t.block_n}x{t.block_k} must divide the scale blocks {block}")
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    split = t.split if counters is not None and tiles_mn <= counters.numel() else 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _fp8_stream_kernel[(tiles_mn, split)](
        x, weight, scale, out, part, counters if split > 1 else out,
        m, n, k, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        FLAT=t.block_m == 1 and block is None and t.flat, BLOCK_SCALES=block is not None, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else 1,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SPLIT_K=split > 1, PIPE=t.stages if t.pipe else None, num_warps=t.warps, num_stages=t.stages,
        SILU_X=silu_x, PRE=t.pre if t.block_m == 1 and block is None and t.flat else 1, **pdl.launch_kwargs(x.device))
    return out


def fp8_stream_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    """The torch reference, in float64: bf16 activations times the dequantized weight."""
    n, k = weight.shape
    if block is None:
        w = weight.double() * scale.double().reshape(n, 1)
    else:
        full = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        w = weight.double() * full
    return x.double() @ w.t()
