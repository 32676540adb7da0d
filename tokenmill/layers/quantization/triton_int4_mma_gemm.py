"""Triton kernel: INT4 W4A16 GEMM for 16..1024 rows reading the tensor-core GEMV's weight layout
(`int4_packing.to_mma`). The aim: one copy of each weight, and no dequantize + cuBLAS pass above
8 rows (it writes and reads the weight in bf16: ~4.5x its int4 bytes).

Operands swapped: out^T [N, M] = W [N, K] x^T [K, M]. The weight tile is the tensor cores' A
operand, made in registers (Hopper's wgmma reads A from registers, B from shared memory), and
x^T is B, loaded through shared memory by Triton's pipeline. Each weight is unpacked once per
BLOCK_M rows of x (a decode batch of 256 in one row tile).

The K order inside a 64-input step: the A tile's column p = 16 m + 8 a + 2 j + b holds input
16 j + 4 m + 2 a + b (word m of lane (g, j), nibble hi + 2 a + 4 b: the layout's own fragment
order, so every word is read once and spread by shifts alone) and x^T's row p is read from the
same input (`_perm_inputs`): the product is unchanged, only the summation order differs.

Measured (H100, docs/results/gpu-int4-gemm.md): 3-17x slower than dequantize + cuBLAS at 16-1024
rows, so `TABLE` / `ROWS_TABLE` are empty and the engine never routes here. Per 64-input step a
CTA waited microseconds: 2-byte scale / zero loads that Triton cannot pipeline (`psz` packs them
into 4-byte words), 4-byte gathers of words (FLAT) and of x (`xperm` permutes x first), and A
converted through shared memory.

Dequantization (DEQ 1, 16-bit activations): the nibble ORed into the mantissa of 128.0 (bf16) or
1024.0 (fp16) is M + q exactly; minus (M + z) is q - z exactly; times the scale rounds once in
the activation dtype: the same weight as dequantize-then-GEMM. DEQ 0 (float32, the interpreter):
(q - z) s in float32.

Torch reference: `int4_packing.dequantize` (of `from_mma`) then a matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_split_k import store_tile

# (magic bits of 128.0 or 1024.0 in the 16-bit dtype, its value) per activation dtype for DEQ 1
_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _perm_inputs(p):
    """The input (within a 64-input step) that A's column / x^T's row p holds."""
    return 16 * ((p // 2) % 4) + 4 * (p // 16) + 2 * ((p // 8) % 2) + p % 2


@triton.jit(do_not_specialize=["M"])
def _mma_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sz_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_sg, s_om,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DEQ: tl.constexpr,
                     MAGIC: tl.constexpr, OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     GROUP_N: tl.constexpr, FLAT: tl.constexpr, SPLIT_K: tl.constexpr, XPERM: tl.constexpr,
                     PACKED_SZ: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    # GROUP_N weight tiles side by side over every row tile: a weight tile is read from HBM once
    # while x's row tiles stay in L2
    per_group = GROUP_N * tiles_m
    pid_m = (pid % per_group) // GROUP_N
    pid_n = (pid // per_group) * GROUP_N + pid % GROUP_N
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels (N is a multiple of BLOCK_N)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dt = x_ptr.dtype.element_ty
    p = tl.arange(0, 64)
    # channel c's words of a 64-input step: (c // 16) (K / 64) 128 + 16 (c % 8) + 4 j + m
    w_row = (offs_c // 16).to(tl.int64) * ((K // 64) * 128) + (offs_c % 8) * 16
    hi = 4 * ((offs_c // 8) % 2)  # channel g + 8: the odd nibbles
    if FLAT:  # each word gathered for its 16 columns of [BN, 64]: elementwise from the load on
        w_ptrs = w_ptr + (w_row[:, None] + ((p // 16) + 4 * ((p // 2) % 4))[None, :])
        shift = hi[:, None] + (8 * ((p // 8) % 2) + 16 * (p % 2))[None, :]
    else:  # each word read once, [BN, 4 m, 4 j], spread by shifts over [BN, 4 m, 2 a, 4 j, 2 b]
        mj = tl.arange(0, 4)
        w_ptrs = w_ptr + (w_row[:, None, None] + mj[None, :, None] + 4 * mj[None, None, :])
        two = tl.arange(0, 2)
        shift = hi[:, None, None, None, None] + 8 * two[None, None, :, None, None] + \
            16 * two[None, None, None, None, :]
    if XPERM:  # x's columns already in A's order (`permuted_rows`): 16-byte loads
        x_ptrs = x_ptr + offs_r[None, :].to(tl.int64) * s_xm + p[:, None]  # x^T [64, BM]
    else:  # gathered in A's order: pairs of inputs (4-byte loads)
        x_ptrs = x_ptr + offs_r[None, :].to(tl.int64) * s_xm + _perm_inputs(p)[:, None]
    r_mask = offs_r[None, :] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_per_split = tl.cdiv(K // 64, split) * 64
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, 64):
        words = tl.load(w_ptrs + (k0 // 64) * 128)
        if FLAT:
            codes = (words >> shift) & 0xF
        else:
            codes = tl.reshape((words[:, :, None, :, None] >> shift) & 0xF, (BLOCK_N, 64))
        g = k0 // GROUP
        if PACKED_SZ:  # one 4-byte word per channel (scale bits low, zero bits high): cp.async can pipeline it
            sz = tl.load(sz_ptr + g * N + offs_c)
            s = (sz & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
            z = (sz >> 16).to(tl.int16).to(dt, bitcast=True)
        else:  # 2-byte loads: not pipelined (cp.async moves 4+ bytes), a round trip every step
            s = tl.load(s_ptr + g * s_sg + offs_c)
            z = tl.load(z_ptr + g * s_sg + offs_c)
        if DEQ == 1:
            q = (codes | MAGIC).to(tl.int16).to(dt, bitcast=True)  # OFFSET + q, exact
            w = ((q - (OFFSET + z.to(tl.float32)).to(dt)[:, None]) * s[:, None]).to(dt)
        else:
            w = ((codes.to(tl.float32) - z.to(tl.float32)[:, None]) * s.to(tl.float32)[:, None]).to(dt)
        # rows past M masked (no EVEN_M specialization: one compile per launch serves every row count)
        xt = tl.load(x_ptrs + k0, mask=r_mask, other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    store_tile(tl.trans(acc), out_ptr, part_ptr, cnt_ptr, offs_r, offs_c, M, N, s_om, pid, pid_k, split, SPLIT_K)


@dataclass(frozen=True)
class GemmTiles:
    """A launch: BLOCK_N weight channels (the wgmma's M: 64 per warpgroup) by BLOCK_M rows of x per
    program, warps, pipeline stages, GROUP_N weight tiles per row-tile sweep, FLAT (the words
    gathered into [BLOCK_N, 64] with no reshape, else read once and spread by a reshape), split-K."""

    block_n: int = 128
    block_m: int = 128
    warps: int = 8
    stages: int = 3
    flat: bool = True
    split: int = 1
    group_n: int = 1
    xperm: bool = False  # x's columns permuted into A's K order first (`permuted_rows`), then 16-byte loads
    psz: bool = False  # scales and zeros packed into one int32 per channel and group (`packed_scales_zeros`)

    def label(self) -> str:
        return (f"gemm n{self.block_n} m{self.block_m} w{self.warps} st{self.stages}"
                f"{'' if self.flat else ' reshape'}{f' s{self.split}' if self.split > 1 else ''}"
                f"{f' gn{self.group_n}' if self.group_n > 1 else ''}{' xperm' if self.xperm else ''}"
                f"{' psz' if self.psz else ''}")

    def code(self) -> str:
        extra = ("" if self.flat else ", flat=False") + (f", split={self.split}" if self.split > 1 else "") + \
            (f", group_n={self.group_n}" if self.group_n > 1 else "") + (", xperm=True" if self.xperm else "") + \
            (", psz=True" if self.psz else "")
        return f"GemmTiles({self.block_n}, {self.block_m}, {self.warps}, {self.stages}{extra})"


# (rows bucket: the most rows it serves, N, K) -> the GEMM's tiles, or None: dequantize + cuBLAS (or the
# GEMV per 8 rows up to `triton_int4_mma.LOOP_MAX_ROWS`) where that measured faster; from
# `scripts/gpu_quant.py --parts int4gemm` (Llama-8B's linears). A shape not listed takes ROWS_TABLE.
TABLE: dict[tuple[int, int, int], GemmTiles | None] = {}
# rows bucket -> tiles for other shapes; rows above the last bucket: dequantize + cuBLAS.
ROWS_TABLE: dict[int, GemmTiles | None] = {}
BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
# False after a failed start-up self-test (`int4.gemm_selftest`): every row count takes the other paths.
ENABLED = True


def gemm_tiles(m: int, n: int, k: int, group: int) -> GemmTiles | None:
    """The GEMM's tiles for an [m, k] x [k, n] product on the mma layout, or None (another path)."""
    bucket = next((b for b in BUCKETS if b >= m), None)
    if bucket is None or not ENABLED:
        return None
    t = TABLE.get((bucket, n, k), ROWS_TABLE.get(bucket))
    return t if t is not None and fits(n, k, group, t.block_n) else None


_PERMS: dict = {}


def permuted_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each 64-column step's columns in A's K order (column p <- input `_perm_inputs(p)`)."""
    k = x.shape[1]
    key = (k, x.device)
    if key not in _PERMS:
        p = torch.arange(k, device=x.device)
        _PERMS[key] = (p // 64) * 64 + _perm_inputs.fn(p % 64)
    return x.index_select(1, _PERMS[key])


def packed_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int32 [G, N]: each channel's 16-bit scale in the low half, its 16-bit zero point in the high half."""
    lo = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi = zeros.contiguous().view(torch.int16).to(torch.int32) << 16
    return lo | hi


def fits(n: int, k: int, group: int, block_n: int) -> bool:
    """The kernel takes a weight of N outputs, K inputs in the mma layout with this BLOCK_N."""
    return n % block_n == 0 and block_n % 16 == 0 and k % 64 == 0 and group % 64 == 0 and k % group == 0


def mma_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             tiles: GemmTiles | None = None, counters: torch.Tensor | None = None, deq: int = 1,
             sz: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype; W in the mma layout qm [N/16, K/64, 32, 4], scales
    and zeros [G, N]. deq 1 needs 16-bit activations (else deq 0 runs). tiles.split > 1: K cut
    into that many slices (`triton_split_k.store_tile`), needs `counters` (zeroed int32, one per
    output tile: `stream_tiles.SplitCounters`; without them, or too few, no split). tiles.psz: the
    scales and zeros packed (`sz`, from `packed_scales_zeros`, else packed here: 16-bit dtypes only)."""
    t = tiles or GemmTiles()
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    if qm.shape[1] * 64 != k or not fits(n, k, group, t.block_n):
        raise ValueError(f"int4 mma GEMM: x {tuple(x.shape)}, weight {tuple(qm.shape)}, group {group} do not fit "
                         f"BLOCK_N {t.block_n} (N a multiple of BLOCK_N, itself of 16; K and the group multiples "
                         f"of 64)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if t.xperm:
        x = permuted_rows(x)
    elif x.stride(1) != 1:
        x = x.contiguous()
    magic, offset = _MAGIC16.get(x.dtype, (0, 0.0))
    deq = deq if x.dtype in _MAGIC16 else 0
    psz = t.psz and scales.element_size() == 2
    if psz and sz is None:
        sz = packed_scales_zeros(scales, zeros)
    tiles_n = n // t.block_n
    group_n = max(1, min(t.group_n, tiles_n))
    while tiles_n % group_n:
        group_n -= 1
    n_tiles = tiles_n * triton.cdiv(m, t.block_m)
    split = t.split if counters is not None and counters.numel() >= n_tiles else 1
    split = max(1, min(split, k // 64))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _mma_gemm_kernel[(n_tiles, split)](
        x, qm, scales, zeros, sz if psz else scales, out, part, counters if split > 1 else out, m, n, k, x.stride(0),
        scales.stride(0),
        out.stride(0), GROUP=group, BLOCK_N=t.block_n, BLOCK_M=t.block_m, DEQ=deq, MAGIC=magic, OFFSET=offset,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_N=group_n,
        FLAT=t.flat, SPLIT_K=split > 1, XPERM=t.xperm, PACKED_SZ=psz, num_warps=t.warps, num_stages=t.stages)
    return out
