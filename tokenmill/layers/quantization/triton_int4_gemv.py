"""Triton kernel: INT4 W4A16 GEMV (one row of x @ W^T, decode at batch 1) near copy bandwidth.

Weights in the panel layout of `int4_packing.to_panels`: int32 [N / P, K / 8, P], the GPTQ-style
words (input channel 8r + i in bits 4i of row r) of P output channels side by side, one panel
after another. A program owns one panel (P output channels) and a slice of K (split-K fills the
SMs: `triton_split_k.store_tile`), so every step reads one contiguous [BLOCK_K / 8, P] block of
words: unmasked 16-byte vector loads (the sizes are checked on the host), nothing strided.
The K loop is a `tl.range` with `num_stages`: Triton software-pipelines (cp.async) the loads of a
loop without `tl.dot` only when the loop carries that attribute, and without it a program waits
for each tile before it computes.
Arithmetic per weight: a shift and one logic op (the nibble into the top mantissa bits of 16.0,
giving the float 16 + q exactly) and one float32 FMA with x; the offset 16 and the zero point
leave through x's sums once per [BLOCK_K / 8, P] tile: sum_k x_k (q - z) = sum_k x_k (16 + q) -
(16 + z) sum_k x_k. Scales and zeros [G, N]: one row of P per step (a step sits in one group).

Torch reference: `int4_packing.dequantize` (of `from_panels`) then a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_panels import panel_prologue
from tokenmill.layers.quantization.triton_split_k import store_tile


@triton.jit
def _nibble_as_float(words, I: tl.constexpr):
    """16 + q for the nibble I of each word: shifted to bits 19..22 (one shift), masked and ORed
    into 16.0's bits (one logic op), bitcast."""
    if I * 4 <= 19:
        t = words << (19 - 4 * I)
    else:
        t = words >> (4 * I - 19)  # arithmetic shift: the bits above the nibble are masked off
    return ((t & (0xF << 19)) | 0x41800000).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_pair_float(words, I: tl.constexpr):
    """offset + q for nibble I, from the copies w << 16 (nibble 0), w << 8 (1, 2), w (3, 4), w >> 8
    (5, 6), w >> 12 (7): odd nibbles below 7 sit at bits 12..15 (2048 + q, exponent 11), the rest
    at bits 16..19 (128 + q, exponent 7). Five shifts for eight weights, one logic op each; the
    compiler keeps the shared copies (CSE). The offsets leave through x's weighted sums (float32:
    2048 x costs ~11 of the accumulator's 24 bits, ~1e-4 relative on a tile's sum)."""
    if I == 0:
        t = words << 16
    elif I <= 2:
        t = words << 8
    elif I <= 4:
        t = words
    elif I <= 6:
        t = words >> 8
    else:
        t = words >> 12
    if I % 2 == 1 and I < 7:
        bits = (t & (0xF << 12)) | 0x45000000
    else:
        bits = (t & (0xF << 16)) | 0x43000000
    return bits.to(tl.float32, bitcast=True)


# Packed-half arithmetic on one word (8 weights): the nibble pairs (i, i + 4) as two fp16 1024 + q
# (one mask-and-or each), minus 1024 + z (exact q - z), times x's pairs, summed in fp16x2 (eight
# products, at most 15 * 2 each: x arrives scaled by a power of two into [1, 2) per row of 8),
# then the two halves added in float32. $0 <- word $1, zero pair $2, x pairs $3..$6.
_HALF2_ASM = tl.constexpr("""{
.reg .b32 q, t, acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
and.b32 t, $1, 0x000F000F;
or.b32 q, t, 0x64006400;
sub.f16x2 q, q, $2;
mul.rn.f16x2 acc, q, $3;
shr.u32 t, $1, 4;
and.b32 t, t, 0x000F000F;
or.b32 q, t, 0x64006400;
sub.f16x2 q, q, $2;
fma.rn.f16x2 acc, q, $4, acc;
shr.u32 t, $1, 8;
and.b32 t, t, 0x000F000F;
or.b32 q, t, 0x64006400;
sub.f16x2 q, q, $2;
fma.rn.f16x2 acc, q, $5, acc;
shr.u32 t, $1, 12;
and.b32 t, t, 0x000F000F;
or.b32 q, t, 0x64006400;
sub.f16x2 q, q, $2;
fma.rn.f16x2 acc, q, $6, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _half_bits(v):
    """The fp16 bits of v (float32) as int32 in the low half."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _word_dot_half(words, z, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """sum_i (q_i - z) x_i over each word's 8 nibbles, in fp16x2 as `_HALF2_ASM` computes it
    (x_i: float32, already scaled into fp16's comfortable range; z: the zero points, [PANEL])."""
    if ASM:
        zz = _half_bits(1024.0 + z)
        zz = zz | (zz << 16)
        xp = (_half_bits(x0) | (_half_bits(x4) << 16), _half_bits(x1) | (_half_bits(x5) << 16),
              _half_bits(x2) | (_half_bits(x6) << 16), _half_bits(x3) | (_half_bits(x7) << 16))
        return tl.inline_asm_elementwise(
            _HALF2_ASM, "=f,r,r,r,r,r,r", [words, zz[None, :], xp[0][:, None], xp[1][:, None], xp[2][:, None],
                                           xp[3][:, None]], dtype=tl.float32, is_pure=True, pack=1)
    # the same arithmetic in Triton ops (the interpreter; and a variant the sweep times)
    zh = z.to(tl.float16)[None, :]
    lo = ((words & 0xF).to(tl.float16) - zh) * x0.to(tl.float16)[:, None]
    hi = (((words >> 16) & 0xF).to(tl.float16) - zh) * x4.to(tl.float16)[:, None]
    lo += (((words >> 4) & 0xF).to(tl.float16) - zh) * x1.to(tl.float16)[:, None]
    hi += (((words >> 20) & 0xF).to(tl.float16) - zh) * x5.to(tl.float16)[:, None]
    lo += (((words >> 8) & 0xF).to(tl.float16) - zh) * x2.to(tl.float16)[:, None]
    hi += (((words >> 24) & 0xF).to(tl.float16) - zh) * x6.to(tl.float16)[:, None]
    lo += (((words >> 12) & 0xF).to(tl.float16) - zh) * x3.to(tl.float16)[:, None]
    hi += (((words >> 28) & 0xF).to(tl.float16) - zh) * x7.to(tl.float16)[:, None]
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _pow2_scale(x0, x1, x2, x3, x4, x5, x6, x7):
    """Per row of 8 x values: (2^-e, 2^e) with 2^(e-1) <= max |x| < 2^e... as float32 bit tricks:
    the largest magnitude's exponent field E gives 2^(127 - E) (scales max |x| into [1, 2)) and
    2^(E - 127) (undoes it). An all-zero row: E = 0, products 0."""
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 1), 253)  # both 2^(127 - E) and 2^(E - 127) normal
    down = ((254 - e) << 23).to(tl.float32, bitcast=True)
    up = (e << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _int4_gemv_kernel(x_ptr, qp_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, N, K, s_sg,
                      GROUP: tl.constexpr, PANEL: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      MODE: tl.constexpr, ASM: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    R: tl.constexpr = BLOCK_K // 8
    offs_r, offs_c, offs_n, panel = panel_prologue(qp_ptr, pid_n, K, PANEL, BLOCK_K)
    tiles_k = K // BLOCK_K
    per_split = tl.cdiv(tiles_k, split)
    t_lo = pid_k * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles_k)
    acc = tl.zeros([R, PANEL], dtype=tl.float32)  # summed over its rows once, at the end
    for t in tl.range(t_lo, t_hi, num_stages=STAGES):
        k0 = t * BLOCK_K
        words = tl.load(panel + (t * R + offs_r)[:, None] * PANEL + offs_c[None, :])
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n).to(tl.float32)
        z = tl.load(z_ptr + g * s_sg + offs_n).to(tl.float32)
        if MODE == 2:  # packed halves (see _HALF2_ASM); x scaled per row of 8 by a power of two
            xb = x_ptr + k0 + offs_r * 8
            x0 = tl.load(xb).to(tl.float32)
            x1 = tl.load(xb + 1).to(tl.float32)
            x2 = tl.load(xb + 2).to(tl.float32)
            x3 = tl.load(xb + 3).to(tl.float32)
            x4 = tl.load(xb + 4).to(tl.float32)
            x5 = tl.load(xb + 5).to(tl.float32)
            x6 = tl.load(xb + 6).to(tl.float32)
            x7 = tl.load(xb + 7).to(tl.float32)
            down, up = _pow2_scale(x0, x1, x2, x3, x4, x5, x6, x7)
            d = _word_dot_half(words, z, x0 * down, x1 * down, x2 * down, x3 * down, x4 * down, x5 * down,
                               x6 * down, x7 * down, ASM)
            acc += (d * up[:, None]) * s[None, :]
        elif MODE == 1:  # two nibbles per shifted copy of the words: 2048 + q at bits 12..15, 128 + q at 16..19
            d = tl.zeros([R, PANEL], dtype=tl.float32)
            xs = tl.zeros([R], dtype=tl.float32)
            xo = tl.zeros([R], dtype=tl.float32)  # sum_i offset_i x_(8r+i)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + k0 + offs_r * 8 + i).to(tl.float32)
                d += _nibble_pair_float(words, i) * xi[:, None]
                xs += xi
                xo += xi * (2048.0 if i % 2 == 1 and i < 7 else 128.0)
            acc += (d - xo[:, None] - xs[:, None] * z[None, :]) * s[None, :]
        else:  # one shift and one logic op per weight: 16 + q at bits 19..22
            d = tl.zeros([R, PANEL], dtype=tl.float32)
            xs = tl.zeros([R], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + k0 + offs_r * 8 + i).to(tl.float32)
                d += _nibble_as_float(words, i) * xi[:, None]
                xs += xi
            acc += (d - xs[:, None] * (16.0 + z)[None, :]) * s[None, :]
    total = tl.sum(acc, axis=0)[None, :]
    store_tile(total, out_ptr, part_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k, split, SPLIT_K)


# The arithmetic per weight (MODE): 0: float32, a shift + a logic op + an FMA per weight; 1: float32,
# shifted copies shared by nibble pairs; 2: fp16x2 (inline PTX on a GPU, its emulation in Triton
# ops under the interpreter), ~2.3 instructions per weight. Products in fp16 cost ~1e-3 relative.
MODES = (0, 1, 2)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gemv_fits(n: int, k: int, group: int, panel: int, block_k: int) -> bool:
    """Whether the unmasked kernel covers this shape: whole panels, whole K steps inside groups."""
    return panel > 0 and n % panel == 0 and k % group == 0 and group % block_k == 0 and block_k % 8 == 0


def int4_gemv(x: torch.Tensor, qpanels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              block_k: int = 64, split: int = 1, warps: int = 4, stages: int = 3, mode: int = 2,
              counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ W^T -> [1, N] in x's dtype, W in the panel layout qpanels [N / P, K / 8, P].
    split > 1 needs `counters` (a zeroed int32 tensor, one per panel: `stream_tiles.SplitCounters`)."""
    m, k = x.shape
    tiles_n, _, panel = qpanels.shape
    n = tiles_n * panel
    group = k if group_size == -1 else group_size
    if m != 1:
        raise ValueError(f"int4 GEMV: one row of activations, got {m}")
    if not gemv_fits(n, k, group, panel, block_k) or qpanels.shape[1] * 8 != k:
        raise ValueError(f"int4 GEMV: panels {tuple(qpanels.shape)} with K {k}, group {group}, BLOCK_K {block_k}: "
                         f"BLOCK_K must be a multiple of 8 dividing the group, which must divide K")
    if x.stride(1) != 1:
        x = x.contiguous()
    if counters is None or counters.numel() < tiles_n:
        split = 1
    split = max(1, min(split, k // block_k))
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, 1, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _int4_gemv_kernel[(tiles_n, split)](
        x, qpanels, scales, zeros, out, part, counters if split > 1 else out, n, k, scales.stride(0),
        GROUP=group, PANEL=panel, BLOCK_K=block_k, STAGES=stages, MODE=mode, ASM=mode == 2 and x.is_cuda and not _interpreting(),
        SPLIT_K=split > 1, num_warps=warps)
    return out
