"""Triton kernel: INT4 W4A16 GEMV (one row of x @ W^T, decode at batch 1) built to stream.

Why a second GEMV (`triton_int4_gemv` is the first): that one reached ~25% of copy bandwidth on
an H200. Its split-K epilogue summed the K slices in a loop of dependent L2 loads run by the last
program alone (16-32 round trips of ~0.2 us at the end of every call), its panels of 512
channels left too few programs to fill the SMs without deep splits, and its arithmetic spent
three shifts per word. Here:
- Weights in the panel layout of `int4_packing.to_panels` (int32 [N / P, K / 8, P]): a program
  owns one panel (P output channels) and K / SPLIT of K; each step reads one contiguous
  [BLOCK_K / 8, P] block (16-byte vector loads, unmasked: the host checks the sizes).
- The K loop keeps the next PREFETCH tiles (words, scales and zeros) in flight in registers: the
  loads of step t + PREFETCH are issued before step t's arithmetic, so HBM latency hides behind
  arithmetic without shared memory. PREFETCH 0: Triton's cp.async pipeline (`tl.range` stages).
- Split-K (SPLIT a compile-time constant): each program stores its float32 partial [P]; the one
  that arrives last (an atomic counter per panel, reset after use, so CUDA-graph replays find it
  zeroed) reads the SPLIT partials in [CHUNK, P] loads issued together (an unrolled loop) and
  sums them in slice order: about one L2 round trip, deterministic.
- Arithmetic per word of 8 weights (MODE; a K tile sits in one group, so scales and zeros are one
  row of P per step):
  0: float32, a shift, a logic op and an FMA per weight (16 + q in 16.0's mantissa);
  3: the nibbles as fp16 1024 + q (nibbles 0, 2, 4, 6) and 1024 + 16 q (1, 3, 5, 7) with one
     logic op per pair and one shift per word, widened to float32 (exact) and FMAed with x
     (x_odd / 16, exact); offsets and zero points leave through x's sums once per tile
     (float32, the 1024 offset costs ~10 of the accumulator's 24 bits: ~1e-5 relative);
  4: the same pairs made q - z exactly in fp16 (a subtraction, or an FMA by 1/16 for the
     16 q pairs), times x's pairs in fp16x2 (x scaled per row of 8 by a power of two into
     [1, 2)), the word's sum widened to float32 (products in fp16: ~1e-3 relative);
  5: mode 4 with x's fp16 pairs made by one packed conversion each;
  6: mode 3 with the tile's rows summed before the offsets, zero points and scales are applied
     (once per column and step, not per word: ~2.5 fewer instructions per word at 4 rows).
  On a GPU modes 3 and 4 are inline PTX; under the interpreter the same arithmetic in Triton ops.

Torch reference: `int4_packing.dequantize` (of `from_panels`) then a matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_int4_gemv import _half_bits, _nibble_as_float, _pow2_scale
from tokenmill.layers.quantization.triton_panels import (grid_dependency_wait, panel_prologue, pdl_supported,
                                                         prefetch_tile_l1)

# Mode 3: $0 <- sum over the word $1's 8 nibbles of (offset + q) * x, x in $2..$9 (float32; the
# odd nibbles' x already divided by 16). Pairs: (0, 4), (1, 5) from the word, (2, 6), (3, 7) from
# the word >> 8.
_F32_ASM = tl.constexpr("""{
.reg .b32 w8, p0, p1, p2, p3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7, a, b;
shr.u32 w8, $1, 8;
lop3.b32 p0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p1, $1, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 p2, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p3, w8, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 {h0, h4}, p0;
mov.b32 {h1, h5}, p1;
mov.b32 {h2, h6}, p2;
mov.b32 {h3, h7}, p3;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
cvt.f32.f16 f4, h4;
cvt.f32.f16 f5, h5;
cvt.f32.f16 f6, h6;
cvt.f32.f16 f7, h7;
mul.f32 a, f0, $2;
mul.f32 b, f4, $6;
fma.rn.f32 a, f1, $3, a;
fma.rn.f32 b, f5, $7, b;
fma.rn.f32 a, f2, $4, a;
fma.rn.f32 b, f6, $8, b;
fma.rn.f32 a, f3, $5, a;
fma.rn.f32 b, f7, $9, b;
add.f32 $0, a, b;
}""")

# Mode 4: $0 <- sum over the word $1's 8 nibbles of (q - z) * x in fp16x2, widened to float32.
# $2: the pair 1024 + z (twice), $3: 64 + z (twice), $4..$7: x's pairs (0, 4), (1, 5), (2, 6),
# (3, 7) as fp16x2 (scaled into [1, 2) per row of 8).
_HALF2_ASM = tl.constexpr("""{
.reg .b32 w8, p0, p1, p2, p3, acc, k16;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 k16, 0x2C002C00;
shr.u32 w8, $1, 8;
lop3.b32 p0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p1, $1, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 p2, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p3, w8, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 p0, p0, $2;
fma.rn.f16x2 p1, p1, k16, $3;
sub.f16x2 p2, p2, $2;
fma.rn.f16x2 p3, p3, k16, $3;
mul.rn.f16x2 acc, p0, $4;
fma.rn.f16x2 acc, p1, $5, acc;
fma.rn.f16x2 acc, p2, $6, acc;
fma.rn.f16x2 acc, p3, $7, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")
# In mode 4's FMAs: k16 is 1/16 twice (fp16 0x2C00); $3 carries -(64 + z), negated on the host side of the asm.


@triton.jit
def _half2(lo, hi):
    """The fp16 pair (lo, hi) as int32 bits, one packed conversion (cvt.rn.f16x2.f32; the single
    conversions of `_half_bits` run on a quarter-rate pipe, two per pair, plus shifts and ors)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _nib(words, I: tl.constexpr):
    return ((words >> (4 * I)) & 0xF).to(tl.float32)


@triton.jit
def _offset_sums(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Mode 3's sums: d [R, P] = sum over each word's nibbles of (offset + q) x (`_F32_ASM`), and
    per row xo = sum of offset_i x_i, xs = sum of x_i (float32 x, [R])."""
    xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
    e = x0 + x2 + x4 + x6
    xo = 1024.0 * e + 64.0 * (xs - e)  # sum of offset_i x_i (the odd x_i enter as x_i / 16)
    if ASM:
        d = tl.inline_asm_elementwise(
            _F32_ASM, "=f,r,f,f,f,f,f,f,f,f",
            [words, x0[:, None], (x1 * 0.0625)[:, None], x2[:, None], (x3 * 0.0625)[:, None], x4[:, None],
             (x5 * 0.0625)[:, None], x6[:, None], (x7 * 0.0625)[:, None]],
            dtype=tl.float32, is_pure=True, pack=1)
    else:  # the same sums in Triton ops: even nibbles 1024 + q, odd ones 1024 + 16 q times x / 16
        d = (1024.0 + _nib(words, 0)) * x0[:, None] + (1024.0 + _nib(words, 4)) * x4[:, None]
        d += (1024.0 + 16.0 * _nib(words, 1)) * (x1 * 0.0625)[:, None]
        d += (1024.0 + 16.0 * _nib(words, 5)) * (x5 * 0.0625)[:, None]
        d += (1024.0 + _nib(words, 2)) * x2[:, None] + (1024.0 + _nib(words, 6)) * x6[:, None]
        d += (1024.0 + 16.0 * _nib(words, 3)) * (x3 * 0.0625)[:, None]
        d += (1024.0 + 16.0 * _nib(words, 7)) * (x7 * 0.0625)[:, None]
    return d, xo, xs


@triton.jit
def _tile_dot_rows_summed(words, s, z, x_base, offs_r, ASM: tl.constexpr):
    """MODE 6: mode 3's sums with the tile's rows summed first, so the offsets, zero points and
    scales apply once per column and step: [P] float32."""
    xb = x_base + offs_r * 8
    d, xo, xs = _offset_sums(words, tl.load(xb).to(tl.float32), tl.load(xb + 1).to(tl.float32),
                             tl.load(xb + 2).to(tl.float32), tl.load(xb + 3).to(tl.float32),
                             tl.load(xb + 4).to(tl.float32), tl.load(xb + 5).to(tl.float32),
                             tl.load(xb + 6).to(tl.float32), tl.load(xb + 7).to(tl.float32), ASM)
    return (tl.sum(d, axis=0) - tl.sum(xo, axis=0) - tl.sum(xs, axis=0) * z) * s


@triton.jit
def _tile_dot(words, s, z, x_base, offs_r, MODE: tl.constexpr, ASM: tl.constexpr):
    """sum over the tile's rows' 8 input channels of (q - z) s x: [R, P] float32 (summed over R by
    the caller, once). words [R, P]; s, z [P] float32; x_base: x at this tile's first channel."""
    xb = x_base + offs_r * 8
    x0 = tl.load(xb).to(tl.float32)
    x1 = tl.load(xb + 1).to(tl.float32)
    x2 = tl.load(xb + 2).to(tl.float32)
    x3 = tl.load(xb + 3).to(tl.float32)
    x4 = tl.load(xb + 4).to(tl.float32)
    x5 = tl.load(xb + 5).to(tl.float32)
    x6 = tl.load(xb + 6).to(tl.float32)
    x7 = tl.load(xb + 7).to(tl.float32)
    if MODE == 0:
        xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        d = _nibble_as_float(words, 0) * x0[:, None]
        d += _nibble_as_float(words, 1) * x1[:, None]
        d += _nibble_as_float(words, 2) * x2[:, None]
        d += _nibble_as_float(words, 3) * x3[:, None]
        d += _nibble_as_float(words, 4) * x4[:, None]
        d += _nibble_as_float(words, 5) * x5[:, None]
        d += _nibble_as_float(words, 6) * x6[:, None]
        d += _nibble_as_float(words, 7) * x7[:, None]
        return (d - xs[:, None] * (16.0 + z)[None, :]) * s[None, :]
    elif MODE == 3:
        d, xo, xs = _offset_sums(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        return (d - xo[:, None] - xs[:, None] * z[None, :]) * s[None, :]
    else:  # MODE 4 (5: the same, x's pairs packed by one conversion instruction each)
        down, up = _pow2_scale(x0, x1, x2, x3, x4, x5, x6, x7)
        x0, x1, x2, x3 = x0 * down, x1 * down, x2 * down, x3 * down
        x4, x5, x6, x7 = x4 * down, x5 * down, x6 * down, x7 * down
        if ASM:
            z1 = _half_bits(1024.0 + z)
            z16 = _half_bits(-(64.0 + z))
            if MODE == 5:
                xp = (_half2(x0, x4), _half2(x1, x5), _half2(x2, x6), _half2(x3, x7))
            else:
                xp = (_half_bits(x0) | (_half_bits(x4) << 16), _half_bits(x1) | (_half_bits(x5) << 16),
                      _half_bits(x2) | (_half_bits(x6) << 16), _half_bits(x3) | (_half_bits(x7) << 16))
            d = tl.inline_asm_elementwise(
                _HALF2_ASM, "=f,r,r,r,r,r,r,r",
                [words, (z1 | (z1 << 16))[None, :], (z16 | (z16 << 16))[None, :], xp[0][:, None], xp[1][:, None],
                 xp[2][:, None], xp[3][:, None]], dtype=tl.float32, is_pure=True, pack=1)
        else:  # fp16 products of exact q - z, summed in fp16 per half as the PTX does
            zh = z.to(tl.float16)[None, :]
            lo = (_nib(words, 0).to(tl.float16) - zh) * x0.to(tl.float16)[:, None]
            hi = (_nib(words, 4).to(tl.float16) - zh) * x4.to(tl.float16)[:, None]
            lo += (_nib(words, 1).to(tl.float16) - zh) * x1.to(tl.float16)[:, None]
            hi += (_nib(words, 5).to(tl.float16) - zh) * x5.to(tl.float16)[:, None]
            lo += (_nib(words, 2).to(tl.float16) - zh) * x2.to(tl.float16)[:, None]
            hi += (_nib(words, 6).to(tl.float16) - zh) * x6.to(tl.float16)[:, None]
            lo += (_nib(words, 3).to(tl.float16) - zh) * x3.to(tl.float16)[:, None]
            hi += (_nib(words, 7).to(tl.float16) - zh) * x7.to(tl.float16)[:, None]
            d = lo.to(tl.float32) + hi.to(tl.float32)
        return (d * up[:, None]) * s[None, :]


@triton.jit
def _k_step(i, t_lo, steps, rot):
    """The K tile a program reads at its i-th step: its slice [t_lo, t_lo + steps) rotated by
    `rot` (STAGGER: programs of neighbouring panels start at different offsets in their slices,
    so that the loads in flight at one time are not all at the same offset modulo the slice)."""
    return t_lo + (i + rot) % steps


@triton.jit
def _prefetch_gemv_kernel(x_ptr, qp_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, N, K, s_sg,
                          GROUP: tl.constexpr, PANEL: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                          PREFETCH: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr,
                          STAGGER: tl.constexpr, PDL: tl.constexpr, L1_AHEAD: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8
    offs_r, offs_c, offs_n, panel = panel_prologue(qp_ptr, pid_n, K, PANEL, BLOCK_K)
    tile_offs = offs_r[:, None] * PANEL + offs_c[None, :]
    steps = K // BLOCK_K // SPLIT  # the host checks that SPLIT divides the K tiles
    t_lo = pid_k * steps
    rot = (pid_n * STAGGER) % steps
    if MODE == 6:  # _tile_dot returns the tile's sum over its rows: [PANEL]
        acc = tl.zeros([PANEL], dtype=tl.float32)
    else:
        acc = tl.zeros([R, PANEL], dtype=tl.float32)
    if PREFETCH < 0:  # steps unrolled by -PREFETCH: ptxas issues the loads of the unrolled steps together
        if PDL:
            grid_dependency_wait()
        for j in range(0, steps, -PREFETCH):
            for u in tl.static_range(-PREFETCH):
                t = _k_step(j + u, t_lo, steps, rot)
                words = tl.load(panel + t * (R * PANEL) + tile_offs)
                g = (t * BLOCK_K) // GROUP
                s = tl.load(s_ptr + g * s_sg + offs_n).to(tl.float32)
                z = tl.load(z_ptr + g * s_sg + offs_n).to(tl.float32)
                if MODE == 6:  # rows summed in the step: acc is [P]
                    acc += _tile_dot_rows_summed(words, s, z, x_ptr + t * BLOCK_K, offs_r, ASM)
                else:
                    acc += _tile_dot(words, s, z, x_ptr + t * BLOCK_K, offs_r, MODE, ASM)
    elif PREFETCH == 0:  # Triton's pipeline (cp.async into shared memory) over the K loop
        if PDL:  # x (and the outputs) belong to the kernels before: wait for them
            grid_dependency_wait()
        for i in tl.range(0, steps, num_stages=STAGES):
            t = _k_step(i, t_lo, steps, rot)
            words = tl.load(panel + t * (R * PANEL) + tile_offs)
            g = (t * BLOCK_K) // GROUP
            s = tl.load(s_ptr + g * s_sg + offs_n).to(tl.float32)
            z = tl.load(z_ptr + g * s_sg + offs_n).to(tl.float32)
            if MODE == 6:  # rows summed in the step: acc is [P]
                acc += _tile_dot_rows_summed(words, s, z, x_ptr + t * BLOCK_K, offs_r, ASM)
            else:
                acc += _tile_dot(words, s, z, x_ptr + t * BLOCK_K, offs_r, MODE, ASM)
    else:  # registers: the tiles of steps i + 1 .. i + PREFETCH are in flight during step i
        t0 = _k_step(0, t_lo, steps, rot)
        w0 = tl.load(panel + t0 * (R * PANEL) + tile_offs)
        g = (t0 * BLOCK_K) // GROUP
        s0 = tl.load(s_ptr + g * s_sg + offs_n)
        z0 = tl.load(z_ptr + g * s_sg + offs_n)
        if PREFETCH == 2:
            t1 = _k_step(tl.minimum(1, steps - 1), t_lo, steps, rot)
            w1 = tl.load(panel + t1 * (R * PANEL) + tile_offs)
            g = (t1 * BLOCK_K) // GROUP
            s1 = tl.load(s_ptr + g * s_sg + offs_n)
            z1 = tl.load(z_ptr + g * s_sg + offs_n)
        if PDL:  # the weights above are the model's (read before the kernels ahead finish); x is theirs
            grid_dependency_wait()
        if L1_AHEAD > 0:  # L1 prefetches of the tiles PREFETCH + 1 .. L1_AHEAD ahead (x's too)
            for d in tl.static_range(PREFETCH + 1, L1_AHEAD + 1):
                if d < steps:
                    prefetch_tile_l1(panel, _k_step(d, t_lo, steps, rot), x_ptr, R, PANEL, BLOCK_K)
        for i in range(0, steps):
            t = _k_step(i, t_lo, steps, rot)
            inext = i + PREFETCH
            if L1_AHEAD > 0:
                if i + L1_AHEAD < steps:
                    prefetch_tile_l1(panel, _k_step(i + L1_AHEAD, t_lo, steps, rot), x_ptr, R, PANEL, BLOCK_K)
            tn = _k_step(tl.minimum(inext, steps - 1), t_lo, steps, rot)
            # past the slice: no words read (rows masked as a whole: the mask is constant along P, so
            # the loads stay 16-byte vectors); scales and zeros of the last step again (a [P] row, unused)
            rows_ok = offs_r[:, None] < tl.where(inext < steps, R, 0)
            wn = tl.load(panel + tn * (R * PANEL) + tile_offs, mask=rows_ok, other=0)
            g = (tn * BLOCK_K) // GROUP
            sn = tl.load(s_ptr + g * s_sg + offs_n)
            zn = tl.load(z_ptr + g * s_sg + offs_n)
            if MODE == 6:  # rows summed in the step: acc is [P]
                acc += _tile_dot_rows_summed(w0, s0.to(tl.float32), z0.to(tl.float32), x_ptr + t * BLOCK_K, offs_r,
                                             ASM)
            else:
                acc += _tile_dot(w0, s0.to(tl.float32), z0.to(tl.float32), x_ptr + t * BLOCK_K, offs_r, MODE, ASM)
            if PREFETCH == 2:
                w0, s0, z0 = w1, s1, z1
                w1, s1, z1 = wn, sn, zn
            else:
                w0, s0, z0 = wn, sn, zn
    if MODE == 6:
        total = acc
    else:
        total = tl.sum(acc, axis=0)
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty))
    else:
        tl.store(part_ptr + pid_k * N + offs_n, total)
        tl.debug_barrier()  # every thread's partial is written before the program counts itself in
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last of the panel's slices: [CHUNK, P] reads all issued at once
            CHUNK: tl.constexpr = SPLIT if SPLIT * PANEL <= 4096 else max(1, 4096 // PANEL)
            total = tl.zeros([PANEL], dtype=tl.float32)
            for c in tl.static_range(SPLIT // CHUNK):  # unrolled: independent loads, summed in slice order
                rows = c * CHUNK + tl.arange(0, CHUNK)
                parts = tl.load(part_ptr + rows[:, None] * N + offs_n[None, :], cache_modifier=".cg")
                total += tl.sum(parts, axis=0)
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


MODES = (0, 3, 4, 5, 6)


@dataclass(frozen=True)
class PrefetchGemv:
    """A launch of this GEMV: panel width (the weight is repacked to it at load), arithmetic
    MODE, BLOCK_K, SPLIT (a power of two dividing the K tiles), warps, PREFETCH depth (0: cp.async
    with `stages`; negative: the K loop unrolled by -PREFETCH steps, which must divide a slice's)."""

    panel: int
    mode: int = 3
    block_k: int = 128
    split: int = 1
    warps: int = 4
    prefetch: int = 1
    stages: int = 3
    stagger: int = 0  # K tiles each panel's slice is rotated by, times the panel index (0: none)
    pdl: bool = False  # programmatic dependent launch (where `triton_panels.pdl_supported`)
    l1_ahead: int = 0  # register prefetch only: L1 prefetches up to this many tiles ahead (CUDA)

    def label(self) -> str:
        return (f"p{self.panel} m{self.mode} k{self.block_k} s{self.split} w{self.warps} pf{self.prefetch}"
                f"{f' st{self.stages}' if not self.prefetch else ''}{f' rot{self.stagger}' if self.stagger else ''}"
                f"{' pdl' if self.pdl else ''}{f' l1{self.l1_ahead}' if self.l1_ahead else ''}")


# (N, K) -> the launch, from `scripts/gpu_quant.py --parts int4sweep` (Llama-8B's linears).
# 2026-11-26 (third session), one H200: the layer's four 70.5 us against 77.3 for the older GEMV
# and 124 for bf16 cuBLAS. Fourth session, mid-session, one H100 (INT4_SWEEP_SET=stream, the
# launches below side by side with the third session's in one process): gate_up staggered 33.7 us
# (34.8 unstaggered), qkv at split 32 staggered 11.1 (12.4); down 19.6 and o 9.4 kept (no variant
# faster beyond noise); the layer 74 us against 76, bf16 163. A shape not here keeps the older GEMV
# (`stream_tiles.gemv_config`). PDL stays off: behind a kernel that does not trigger early (every
# kernel ahead of a GEMV today) it measured 0 to 0.6 us slower per linear.
TABLE: dict[tuple[int, int], PrefetchGemv] = {
    (28672, 4096): PrefetchGemv(512, mode=3, block_k=32, split=8, warps=4, prefetch=1, stagger=1),
    (4096, 14336): PrefetchGemv(128, mode=4, block_k=64, split=32, warps=1, prefetch=1),
    (6144, 4096): PrefetchGemv(128, mode=4, block_k=64, split=32, warps=1, prefetch=1, stagger=1, l1_ahead=3),
    (4096, 4096): PrefetchGemv(128, mode=4, block_k=64, split=32, warps=1, prefetch=1),
}


def config_for(n: int, k: int, group: int) -> PrefetchGemv | None:
    """The measured launch for this shape if the weight fits it, else None."""
    c = TABLE.get((n, k))
    return c if c is not None and fits(n, k, group, c) else None


def fits(n: int, k: int, group: int, c: PrefetchGemv) -> bool:
    """Whole panels of a power-of-two width, K tiles inside groups, SPLIT a power of two dividing
    the K tiles."""
    return (c.panel > 0 and c.panel & (c.panel - 1) == 0 and n % c.panel == 0 and c.block_k % 8 == 0 and k % group == 0 and group % c.block_k == 0
            and c.split >= 1 and c.split & (c.split - 1) == 0 and (k // c.block_k) % c.split == 0
            and (c.prefetch >= 0 or (k // c.block_k // c.split) % -c.prefetch == 0))


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def prefetch_gemv(x: torch.Tensor, qpanels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  c: PrefetchGemv, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ W^T -> [1, N] in x's dtype; W in the panel layout qpanels [N / P, K / 8, P] with
    P == c.panel. c.split > 1 needs `counters` (zeroed int32, one per panel: `SplitCounters`)."""
    m, k = x.shape
    tiles_n, k8, panel = qpanels.shape
    n = tiles_n * panel
    group = k if group_size == -1 else group_size
    if m != 1:
        raise ValueError(f"int4 GEMV: one row of activations, got {m}")
    if panel != c.panel or k8 * 8 != k or not fits(n, k, group, c):
        raise ValueError(f"int4 GEMV: panels {tuple(qpanels.shape)} with K {k}, group {group} do not fit {c.label()} "
                         f"(BLOCK_K a multiple of 8 dividing the group; SPLIT a power of two dividing K / BLOCK_K)")
    if c.split > 1 and (counters is None or counters.numel() < tiles_n):
        raise ValueError(f"int4 GEMV: split {c.split} needs {tiles_n} zeroed counters")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = torch.empty((c.split, n), dtype=torch.float32, device=x.device) if c.split > 1 else out
    gpu = x.is_cuda and not _interpreting()
    pdl = c.pdl and gpu and pdl_supported(x.device)
    _prefetch_gemv_kernel[(tiles_n, c.split)](
        x, qpanels, scales, zeros, out, part, counters if c.split > 1 else out, n, k, scales.stride(0),
        GROUP=group, PANEL=panel, BLOCK_K=c.block_k, SPLIT=c.split, PREFETCH=c.prefetch, STAGES=c.stages,
        MODE=c.mode, ASM=c.mode in (3, 4, 5, 6) and gpu, STAGGER=c.stagger, PDL=pdl,
        L1_AHEAD=c.l1_ahead if gpu and c.prefetch > 0 else 0, num_warps=c.warps,
        **({"launch_pdl": True} if pdl else {}))
    return out
