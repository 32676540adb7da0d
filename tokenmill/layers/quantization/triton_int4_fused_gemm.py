"""Triton kernel: INT4 W4A16 GEMM for 16..1024 rows, the weight dequantized in registers once per
BLOCK_M rows and multiplied on the tensor cores (x @ W^T, no act-order).

Aimed at decode batches of 64-256 rows, where dequantize + cuBLAS pays a full bf16 write and
read of the weight on every call. BLOCK_M up to 256 covers a whole batch of 256 in one row tile,
so each weight is unpacked once per call; the arithmetic per weight stays small:
- DEQ 1 (16-bit activations): the nibble ORed into the mantissa of 128.0 in the activation
  dtype (bf16: 7 mantissa bits; fp16 uses 1024.0 and 10 bits) gives 128 + q exactly with one
  shift and one logic op; (128 + q) - (128 + z) is exact, times the scale rounded once into the
  activation dtype: the same rounding as dequantize-then-GEMM.
- DEQ 0: float32 (16 + q in 16.0's mantissa) times s minus (16 + z) s, then rounded (the float32
  and interpreter path).
Weights in the kernel layout (words [K/8, N]) or the panels of `int4_packing.to_panels` (what the
engine keeps on CUDA). A K tile sits in one group: its scales and zeros are one row.

Torch reference: `int4_packing.dequantize` then a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_int4_stream import word_offsets
from tokenmill.layers.quantization.triton_split_k import store_tile

# (magic bits of 128.0 or 1024.0 in the 16-bit dtype, its value) per activation dtype for DEQ 1
_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit(do_not_specialize=["M"])
def _int4_fused_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_qk, s_sg, s_om,
                       GROUP: tl.constexpr, PANEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DEQ: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_M: tl.constexpr,
                       EVEN_N: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # the row tiles of one weight tile run side by side: it is read from HBM once
    pid_n = pid // tiles_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    dt = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_per_split = tl.cdiv(K // BLOCK_K, split) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # whole tiles (EVEN_*) load unmasked: predicates and selects cost the dequantization's issue slots
        w_ptrs = qw_ptr + word_offsets(k0 // 8 + offs_r, offs_n, s_qk, K, PANEL)
        g = k0 // GROUP
        if EVEN_N:
            words = tl.load(w_ptrs)
            s = tl.load(s_ptr + g * s_sg + offs_n)
            z = tl.load(z_ptr + g * s_sg + offs_n)
        else:
            words = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
            s = tl.load(s_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0)
            z = tl.load(z_ptr + g * s_sg + offs_n, mask=n_mask, other=0.0)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_M:
            x = tl.load(x_rows + offs_k[None, :])
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        nib = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: channel 8r + i
        if DEQ == 1:
            q = tl.reshape(nib | MAGIC, (BLOCK_K, BLOCK_N)).to(tl.int16).to(dt, bitcast=True)  # OFFSET + q, exact
            w = ((q - (OFFSET + z.to(tl.float32)).to(dt)[None, :]) * s.to(dt)[None, :]).to(dt)
        else:
            q = tl.reshape((nib << 19) | 0x41800000, (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True)  # 16 + q
            s32 = s.to(tl.float32)
            w = (q * s32[None, :] - ((16.0 + z.to(tl.float32)) * s32)[None, :]).to(dt)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, pid, pid_k, split, SPLIT_K)


# From these rows the fused GEMM runs with its (block_m, block_n, block_k, warps, stages, deq, split), or
# None (from there the other paths again); from `scripts/gpu_quant.py --parts int4sweep` (an H200).
# Empty: measured slower everywhere (2026-11-26, the layer's four at its best tiles: 64 rows 245 us
# vs 180 for the streaming tiles; 256 rows 403 vs 359 for dequantize + cuBLAS, gate_up alone a tie;
# 1024 rows 1203 vs 750). Triton waits for each wgmma before the next tile's dequantization
# (`warp_group_dot_wait` 0: a register-made operand is stored to one shared buffer), so the
# dequantization does not overlap the tensor cores.
FusedTiles = tuple[int, int, int, int, int, int, int]
FUSED_ROWS: tuple[tuple[int, FusedTiles | None], ...] = ()
# (N, K) -> the same kind of list for one shape (measured per Llama-8B linear); else FUSED_ROWS.
FUSED_SHAPES: dict[tuple[int, int], tuple[tuple[int, FusedTiles | None], ...]] = {}


def fused_tiles(m: int, n: int = 0, k: int = 0) -> FusedTiles | None:
    """The fused GEMM's tiles for an [m, k] x [k, n] product, or None where another path runs."""
    tiles = None
    for rows, t in FUSED_SHAPES.get((n, k), FUSED_ROWS):
        if m >= rows:
            tiles = t
    return tiles


def int4_fused_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, block_m: int = 256, block_n: int = 128, block_k: int = 64, warps: int = 8,
                    stages: int = 3, deq: int = 1, split: int = 1, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized W^T -> [M, N] in x's dtype (no act-order); qweight: words [K/8, N]
    or panels [N / P, K/8, P]. deq 1 needs 16-bit activations (else deq 0 runs). split > 1:
    split-K (few output tiles: o and down at 256 rows), needs `counters` (zeroed int32, one per
    output tile: `stream_tiles.SplitCounters`; without them, or too few, no split)."""
    m, k = x.shape
    panel = qweight.shape[2] if qweight.dim() == 3 else 0
    n = qweight.shape[0] * panel if panel else qweight.shape[1]
    group = k if group_size == -1 else group_size
    if k % group or group % block_k or block_k % 8:
        raise ValueError(f"int4 fused GEMM: BLOCK_K {block_k} must be a multiple of 8 dividing the group size "
                         f"{group}, which must divide K {k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    magic, offset = _MAGIC16.get(x.dtype, (0, 0.0))
    deq = deq if x.dtype in _MAGIC16 else 0
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if counters is None or counters.numel() < tiles:
        split = 1
    split = max(1, min(split, k // block_k))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _int4_fused_kernel[(tiles, split)](
        x, qweight, scales, zeros, out, part, counters if split > 1 else out, m, n, k, x.stride(0),
        qweight.stride(0) if not panel else 0, scales.stride(0), out.stride(0), GROUP=group, PANEL=panel,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DEQ=deq, MAGIC=magic, OFFSET=offset,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_K=split > 1,
        EVEN_M=m % block_m == 0, EVEN_N=n % block_n == 0, num_warps=warps, num_stages=stages)
    return out
