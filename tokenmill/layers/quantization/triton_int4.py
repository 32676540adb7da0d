"""Triton kernel: W4A16 GEMM that dequantizes int4 weights in registers (x @ W^T), and the
dispatch `int4_matmul`. Since the streaming kernel (`triton_int4_stream`) this one serves
act-order weights (g_idx) and groups not a multiple of 16 only.

Weights in the kernel layout of `int4_packing.Int4Weights`: `qweight` int32 [K/8, N] (input
channel 8r + i in bits 4i of row r), `scales` / `zeros` [G, N] in the activation dtype,
optional `g_idx` int32 [K] (act-order: each input channel's group, gathered per channel).
Without g_idx, a K tile never straddles two groups (BLOCK_K divides the group size), so its
scales and zeros are one row, loaded once per tile.

Small batches (decode) are bound by reading the weight, a quarter of bf16's: tiles of 16 rows
and split-K (programs add their partial sums into a float32 output) so that every SM streams
weights. Medium batches use wide tiles and no split. Large batches (prefill, from
`DEQUANT_MIN_ROWS` rows) are compute-bound: `dequantize_int4` writes W^T [K, N] in the
activation dtype (reading int4, writing 16 bits: small next to the GEMM) and cuBLAS multiplies.
The torch reference of both is `int4_packing.dequantize` followed by a matmul.

Requires triton at import; `int4.py` imports this module lazily.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_int4_stream import word_offsets

logger = logging.getLogger(__name__)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    a_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, c_ptr,
    M, N, K, s_am, s_qk, s_sg, s_cm,
    GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UNPACK_3D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UNPACK_3D:  # each word loaded once, its 8 nibbles spread over 8 rows by a reshape
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(qw_ptr + offs_w[:, None].to(tl.int64) * s_qk + offs_n[None, :],
                            mask=(offs_w < K // 8)[:, None] & n_mask[None, :], other=0)
            nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32)
        else:  # each word loaded by the 8 rows it holds (cached, but 8x the load instructions)
            packed = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * s_qk + offs_n[None, :],
                             mask=k_mask[:, None] & n_mask[None, :], other=0)
            q = ((packed >> shifts[:, None]) & 0xF).to(tl.float32)
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0).to(tl.int64)
            sz_off = g[:, None] * s_sg + offs_n[None, :]
            sz_mask = k_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            w = (q - z) * s
        else:
            g = k0 // GROUP
            s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    c_off = offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(c_ptr + c_off, acc, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, s_qk, s_sg, s_wk,
                         GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, PANEL: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    packed = tl.load(qw_ptr + word_offsets(offs_k // 8, offs_n, s_qk, K, PANEL), mask=mask, other=0)
    q = ((packed >> ((offs_k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0).to(tl.int64)
    else:
        g = (offs_k // GROUP).to(tl.int64)
    sz_off = g[:, None] * s_sg + offs_n[None, :]
    s = tl.load(s_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(w_ptr + offs_k[:, None].to(tl.int64) * s_wk + offs_n[None, :], ((q - z) * s).to(w_ptr.dtype.element_ty),
             mask=mask)


# Act-order weights: from this many rows the dequantize-then-cuBLAS path runs (`int4_matmul`): the fused kernel's
# tiles cannot match cuBLAS where the GEMM is compute-bound. A guess for an H100 until measured
# (scripts/gpu_quant.py --parts micro times both); batches captured in CUDA graphs stay below it.
DEQUANT_MIN_ROWS = 1024


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
                    group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The kernel layout back to W^T [K, N] in `dtype` (== int4_packing.dequantize); qweight:
    words [K/8, N] or panels [N / P, K/8, P]."""
    panel = qweight.shape[2] if qweight.dim() == 3 else 0
    k, n = qweight.shape[-2] * 8, (qweight.shape[0] * panel if panel else qweight.shape[1])
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _int4_dequant_kernel[grid](qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, n, k,
                               qweight.stride(0), scales.stride(0), out.stride(0),
                               GROUP=k if group_size == -1 else group_size, HAS_GIDX=g_idx is not None,
                               BLOCK_K=block_k, BLOCK_N=block_n, PANEL=panel, num_warps=4)
    return out


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, counters: torch.Tensor | None = None,
                x_kperm: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T. Without act-order: `triton_int4_stream` (GEMV / split-K at small batches,
    tensor-core tiles above) below `stream_tiles.INT4_DEQUANT_MIN_ROWS` rows. Act-order (g_idx):
    the per-channel-group kernel below DEQUANT_MIN_ROWS rows. Above either: dequantize + cuBLAS.
    counters: the layer's split-K counters (`stream_tiles.SplitCounters`). qweight in panels
    (3-D, `int4_packing.to_panels`; no act-order): one row takes the GEMV of `triton_int4_gemv`.
    qweight in the mma layout (4-D, `int4_packing.to_mma`): `triton_int4_mma.mma_matmul`.
    x_kperm: x's columns in the swapped GEMM's K order (`int4_kperm`), put back for any other path."""
    from tokenmill.layers.quantization import stream_tiles

    m = x.shape[0]
    group = x.shape[1] if group_size == -1 else group_size
    if qweight.dim() == 4:  # the tensor-core GEMV's layout (`int4.for_device`): every row count
        from tokenmill.layers.quantization.triton_int4_mma import mma_matmul

        return mma_matmul(x, qweight, scales, zeros, group_size, counters, x_kperm=x_kperm)
    if x_kperm:
        from tokenmill.layers.quantization.int4_kperm import unpermute

        x = unpermute(x)
    if m == 1 and qweight.dim() == 3:
        from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv

        n, k = qweight.shape[0] * qweight.shape[2], x.shape[1]
        from tokenmill.layers.quantization import triton_int4_prefetch_gemv as prefetch

        pc = prefetch.config_for(n, k, group)
        if pc is not None and pc.panel == qweight.shape[2]:
            if pc.split > 1 and (counters is None or counters.numel() < qweight.shape[0]):
                from dataclasses import replace

                # no counters for the split-K sum: one program per panel (an unroll may not divide its steps)
                pc = replace(pc, split=1, prefetch=1 if pc.prefetch < 0 else pc.prefetch)
            return prefetch.prefetch_gemv(x, qweight, scales, zeros, group_size, pc, counters)
        c = stream_tiles.gemv_config(n, k, group, stream_tiles.sm_count(x.device))
        if c.mode == stream_tiles.STREAM:
            from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

            return int4_stream_gemm(x, qweight, scales, zeros, group_size, counters)
        return int4_gemv(x, qweight, scales, zeros, group_size, c.block_k, c.split, c.warps, c.stages, c.mode,
                         counters)
    if g_idx is None and group % 16 == 0 and m < stream_tiles.INT4_DEQUANT_MIN_ROWS:
        from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

        return int4_stream_gemm(x, qweight, scales, zeros, group_size, counters)
    if m >= (DEQUANT_MIN_ROWS if g_idx is not None else stream_tiles.INT4_DEQUANT_MIN_ROWS):
        return x @ dequantize_int4(qweight, scales, zeros, g_idx, group_size, x.dtype)
    return int4_gemm(x, qweight, scales, zeros, g_idx, group_size)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_tiles(m: int, n: int, k: int, group: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps) for an [m, k] x [k, n] product."""
    block_k = min(64, group)
    if m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 64, 64, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, min(32, group), 8
    split = 1
    if m <= 64 and device.type == "cuda":
        programs = -(-m // block_m) * -(-n // block_n)
        target = 2 * _sm_count(device.index or 0)
        split = max(1, min(-(-target // programs), k // (block_k * 4), 16))
    return block_m, block_n, block_k, split, warps


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor | None, group_size: int, tiles: tuple[int, int, int, int, int] | None = None,
              unpack_3d: bool | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized W^T [K, N] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    group = k if group_size == -1 else group_size
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_n, block_k, split, warps = tiles or choose_tiles(m, n, k, group, x.device)
    if g_idx is None and group % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group}")
    out = (torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1
           else torch.empty((m, n), dtype=x.dtype, device=x.device))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    unpack_3d = UNPACK_3D if unpack_3d is None else unpack_3d
    try:
        _int4_gemm_kernel[grid](
            x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
            m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
            GROUP=group, HAS_GIDX=g_idx is not None, SPLIT_K=split,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UNPACK_3D=unpack_3d,
            num_warps=warps, num_stages=3,
        )
    except Exception:  # noqa: BLE001 - a compile failure (its type varies by stage); retried below
        if not unpack_3d:
            raise
        _disable_unpack_3d()  # compile-time only (warm-up runs every shape before graphs capture)
        return int4_gemm(x, qweight, scales, zeros, g_idx, group_size, tiles, unpack_3d=False)
    return out.to(x.dtype) if split > 1 else out


# Unpack a tile's words with a reshape (one load per word) rather than a load per nibble row.
# A Triton that cannot compile the reshape turns it off, loudly, for the process.
UNPACK_3D = True


def _disable_unpack_3d() -> None:
    global UNPACK_3D
    UNPACK_3D = False
    logger.warning("int4 GEMM: the word-unpacking reshape did not compile on this Triton; using the "
                   "per-row loads (slower at decode)", exc_info=True)
