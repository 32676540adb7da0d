"""Triton kernel: INT4 W4A16 GEMV for 1..8 rows on the tensor cores (mma.sync m16n8k16, CUDA
cores only unpack), and the dequantization of its weight layout for more rows.

Why: the CUDA-core GEMVs (`triton_int4_prefetch_gemv`) spend ~36-42 instructions per word of 8
weights (unpack, convert, zero point, FMA with x, widen): as long as the read of the word itself
on an H100, so they reach about half of the byte bound. Here a word is exactly one mma A fragment
(8 bf16/fp16 weights of one thread), and its arithmetic is 3 shifts, 4 logic ops, 4 packed
subtractions and a quarter of an mma (~12 instructions):
- the nibbles go into the mantissa of 128.0 (bf16) / 1024.0 (fp16) with one `lop3` per pair,
  giving M + q exactly; a packed FMA with -(M + z) makes q - z exactly (an integer in [-15, 15]);
- the mma multiplies them by x (the B operand: row r of x in column r, rows >= M zero) and sums
  in float32; per group the sums are scaled in float32 (no rounding of the weight: closer to
  exact than dequantize-then-GEMM).

Layout (`int4_packing.to_mma`): int32 [N/16, K/64, 32, 4]. A warp owns 16 output channels (a
"channel block"); a 64-channel K step of a block is 32 lanes x 4 words (512 contiguous bytes: one
16-byte load per lane). Lane t (g = t / 4, j = t % 4) holds, in word m, the codes of channels
g and g + 8 at input channels k = 64 s + 16 j + 4 m + (0..3): the mma's k positions 2j, 2j+1,
2j+8, 2j+9 are mapped to 4 consecutive inputs so that a lane's x values for a step are 16
consecutive values (two 16-byte loads). Nibble n of a word: channel g + 8 (n % 2), input offset
2 ((n % 4) // 2) + n // 4.

Scales and zeros stay [G, N] in the activation dtype (`Int4Weights`); zero points must be
integers in [0, 127] (every supported format's are in [0, 16]). A group is a multiple of 64.

The program: a CTA of WARPS warps owns WARPS channel blocks and K / SPLIT of K (whole groups).
On a GPU the loop body is one inline-PTX block per GPC groups (all its loads first, then the
arithmetic: ptxas cannot move the loads behind it), the lane index read from %tid. Partial sums
of SPLIT > 1 slices go to a float32 buffer; the CTA that arrives last for its channel blocks
(one counter each, reset after use: CUDA-graph replays find it zeroed) sums them in slice order.
Under the interpreter (CPU tests) the same program runs in Triton ops: the codes gathered from
the layout by the inverse index map (`_codes_at`), checked against the torch reference.

Torch reference: `int4_packing.dequantize` (of `from_mma`) then a matmul.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.int4_mma_fold import (
    _add_into_stream,
    _norm_rows,
    _rows_rstd,
)

# (the launch records and the table, re-exported: callers name them through this module)
from tokenmill.layers.quantization.int4_mma_launch import (  # noqa: F401
    MAX_GROUP,
    TABLE,
    TABLE_ENV,
    TARGET_WARPS_PER_SM,
    MmaGemv,
    default_config,
    fits,
    layout_fits,
    parse_label,
    table,
)
from tokenmill.layers.triton_ops import pdl

ROWS = 8  # rows of x one launch takes (the mma's N)


def _setup_asm() -> str:
    """PTX of the thread's element offsets, once per program: $0 into the weight (its channel
    block's words, its lane's 16 bytes), $1 into x (row min(g, M - 1): rows past M are read but
    their sums never stored; its lane's 16 inputs), $2 into scales / zeros (channel g of its
    block). $3 words between channel blocks, $4 x's row stride, $5 M (r)."""
    return "\n".join([
        "{", ".reg .b32 tid, wid, lane, g, j, u, v;",
        "mov.u32 tid, %tid.x;", "shr.u32 wid, tid, 5;", "and.b32 lane, tid, 31;", "shr.u32 g, lane, 2;",
        "and.b32 j, lane, 3;",
        "shl.b32 u, lane, 2;", "mad.lo.u32 u, wid, $3, u;", "cvt.u64.u32 $0, u;",
        "sub.u32 v, $5, 1;", "min.u32 v, g, v;", "shl.b32 u, j, 4;", "mad.lo.u32 u, v, $4, u;", "cvt.u64.u32 $1, u;",
        "shl.b32 u, wid, 4;", "add.u32 u, u, g;", "cvt.u64.u32 $2, u;", "}"])


def _asm(spg: int, gpc: int, f16: bool, early: bool = True, zmma: bool = False, hint: bool = False,
         words_in: bool = False, ahead: str = "", ring: int = 0, warps: int = 4) -> str:
    """The PTX of one loop step: GPC groups of SPG 64-input K steps, for the calling thread.
    Operands: $0..$3 its four float32 sums out (channel g rows 2j, 2j+1; channel g+8 rows 2j,
    2j+1); $4 its weight words at this step, $5 its x values, $6 / $7 its scale / zero (channel
    g; g + 8 is 16 bytes on) at this group (l); $8 bytes between groups in scales / zeros, $9 M
    (r); $10..$13 the four sums in (f).
    early: a false-at-run-time predicate computed from one register of every load, right after
    the loads: ptxas must issue them all before any arithmetic (it otherwise sinks each load to
    just before its first use, serialising their latencies).
    zmma: the zero points leave through a second mma per word, of the A fragment -(M + z) (each
    channel's, constant along k) with the same x, into the same sums, instead of four packed
    subtractions per word (the weights enter as M + q; sums ~M / 8 times larger in float32).
    hint: the weight loads skip L1 (read once; L1 keeps x) and ask L2 for 256-byte fetches.
    words_in: the step's weight words are operands $14.. (loaded by `_preload_asm` before the PDL
    wait), not loaded here.
    ahead ("L1" / "L2", not with words_in): first, `prefetch.global.<ahead>` of the words at $14
    (l: a later step's, the kernel clamps it to its slice), so a step's loads find them in cache
    while the DRAM reads of the steps after it are already in flight (no registers held).
    ring (RING K steps, a multiple of the step's): the words come through a per-thread ring of
    shared memory filled by cp.async RING K steps ahead (each lane reads back only its own 16
    bytes: no barrier); the first step (`$16` nonzero) fills it. Operands $14 the words RING K
    steps on (l), $15 how many of those K steps lie in the slice (r), $16 first (r), $17 this
    step's first slot (r). Bytes in flight without registers: RING x 512 per warp."""
    magic = "0x64006400" if f16 else "0x43004300"
    one = "0x3C003C00" if f16 else "0x3F803F80"
    big = "0f44800000" if f16 else "0f43000000"  # 1024.0 / 128.0
    ty = "f16" if f16 else "bf16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    steps = spg * gpc
    lines = ["{", ".reg .b32 u, sh, one2, nz0, nz8, p0, p1, p2, p3, za0, za1, za2, za3;", ".reg .b16 h0;", ".reg .b64 sa, za, o64;",
             ".reg .f32 d0, d1, d2, d3, s0, s8, z0, z8;",
             f".reg .b32 w<{4 * steps}>, x<{8 * steps}>, sz<{4 * gpc}>;",
             f"mov.b32 one2, {one};", "mov.f32 $0, $10;", "mov.f32 $1, $11;", "mov.f32 $2, $12;", "mov.f32 $3, $13;"]
    if ahead:
        lines += [f"prefetch.global.{ahead} [$14+{512 * t}];" for t in range(steps)]
    stride = warps * 32 * 16  # bytes of one ring slot (a K step of the CTA's threads)
    cp = "cp.async.cg.shared.global" + (".L2::256B" if hint else "")
    if ring:
        lines += [f".shared .align 16 .b8 i4ring[{ring * stride}];", ".reg .b32 rb, rl, ra, rs;", ".reg .pred pf, pt;",
                  "mov.u32 rb, i4ring;", "mov.u32 rl, %tid.x;", "shl.b32 rl, rl, 4;", "add.u32 rb, rb, rl;",
                  "setp.ne.u32 pf, $16, 0;"]
        for d in range(ring):  # the first step fills the ring (its slice holds at least RING K steps)
            lines.append(f"@pf {cp} [rb+{d * stride}], [$4+{512 * d}], 16;")
            if (d + 1) % steps == 0:
                lines.append("@pf cp.async.commit_group;")
        lines += [f"cp.async.wait_group {ring // steps - 1};", f"mul.lo.u32 rs, $17, {stride};", "add.u32 rs, rs, rb;"]
    for t in range(steps):  # every load first
        if ring:
            lines.append(f"ld.shared.v4.b32 {{w{4 * t}, w{4 * t + 1}, w{4 * t + 2}, w{4 * t + 3}}}, [rs+{t * stride}];")
        elif words_in:
            lines += [f"mov.b32 w{4 * t + m}, ${14 + 4 * t + m};" for m in range(4)]
        else:
            lines.append(f"{_ld_words(hint)} {{w{4 * t}, w{4 * t + 1}, w{4 * t + 2}, w{4 * t + 3}}}, [$4+{512 * t}];")
    for t in range(steps):
        for half in range(2):
            regs = ", ".join(f"x{8 * t + 4 * half + i}" for i in range(4))
            lines.append(f"ld.global.v4.b32 {{{regs}}}, [$5+{128 * t + 16 * half}];")
    # scales and zeros of channels g and g + 8, each group's: sz[4q + 0..3] = s(g), s(g+8), z(g), z(g+8)
    lines += ["mov.b64 sa, $6;", "mov.b64 za, $7;", "cvt.u64.u32 o64, $8;"]
    for q in range(gpc):
        if q:
            lines += ["add.s64 sa, sa, o64;", "add.s64 za, za, o64;"]
        lines += [f"ld.global.nc.u16 sz{4 * q}, [sa];", f"ld.global.nc.u16 sz{4 * q + 1}, [sa+16];",
                  f"ld.global.nc.u16 sz{4 * q + 2}, [za];", f"ld.global.nc.u16 sz{4 * q + 3}, [za+16];"]
    if early:  # dep = xor of one register per load; pz = (dep == 0) and (M == 0): never true
        firsts = ([f"w{4 * t}" for t in range(steps)] + [f"x{8 * t + 4 * half}" for t in range(steps) for half in range(2)]
                  + [f"sz{i}" for i in range(4 * gpc)])
        lines += [".reg .b32 dep;", ".reg .pred pa, pz;", f"mov.b32 dep, {firsts[0]};"]
        for a in range(1, len(firsts), 2):
            b = firsts[a + 1] if a + 1 < len(firsts) else "0"
            lines.append(f"lop3.b32 dep, dep, {firsts[a]}, {b}, 0x96;")
        lines += ["setp.eq.u32 pa, $9, 0;", "setp.eq.and.u32 pz, dep, 0, pa;", "@pz mov.f32 $0, 0f7FC00000;"]
    if ring:  # the slots just read (dep consumed them) take the words RING K steps on
        for t in range(steps):
            lines += [f"setp.gt.s32 pt, $15, {t};", f"@pt {cp} [rs+{t * stride}], [$14+{512 * t}], 16;"]
        lines.append("cp.async.commit_group;")
    for q in range(gpc):
        # float32 scales, and -(M + z) pairs, of channels g and g + 8
        for reg, src in (("s0", 0), ("s8", 1), ("z0", 2), ("z8", 3)):
            if f16:
                lines += [f"cvt.u16.u32 h0, sz{4 * q + src};", f"cvt.f32.f16 {reg}, h0;"]
            else:
                lines += [f"shl.b32 u, sz{4 * q + src}, 16;", f"mov.b32 {reg}, u;"]
        for z, nz in (("z0", "nz0"), ("z8", "nz8")):
            lines += [f"add.f32 {z}, {z}, {big};", f"neg.f32 {z}, {z};", f"cvt.rn.{ty}x2.f32 {nz}, {z}, {z};"]
        if zmma:  # the zero points' A fragment in four registers of its own (one quad for ptxas, per group)
            lines += ["mov.b32 za0, nz0;", "mov.b32 za1, nz8;", "mov.b32 za2, nz0;", "mov.b32 za3, nz8;"]
        lines += [f"mov.f32 d{i}, 0f00000000;" for i in range(4)]
        for h in range(spg):
            t = q * spg + h
            for m in range(4):
                w = f"w{4 * t + m}"
                xb = f"{{x{8 * t + 2 * m}, x{8 * t + 2 * m + 1}}}"
                lines.append(f"lop3.b32 p0, {w}, 0x000F000F, {magic}, 0xEA;")
                for i, p in ((1, "p1"), (2, "p2"), (3, "p3")):
                    lines += [f"shr.u32 sh, {w}, {4 * i};", f"lop3.b32 {p}, sh, 0x000F000F, {magic}, 0xEA;"]
                if zmma:
                    lines.append(f"{mma} {{d0, d1, d2, d3}}, {{za0, za1, za2, za3}}, {xb}, {{d0, d1, d2, d3}};")
                else:
                    lines += [f"fma.rn.{ty}x2 p0, p0, one2, nz0;", f"fma.rn.{ty}x2 p1, p1, one2, nz8;",
                              f"fma.rn.{ty}x2 p2, p2, one2, nz0;", f"fma.rn.{ty}x2 p3, p3, one2, nz8;"]
                lines.append(f"{mma} {{d0, d1, d2, d3}}, {{p0, p1, p2, p3}}, {xb}, {{d0, d1, d2, d3}};")
        lines += ["fma.rn.f32 $0, d0, s0, $0;", "fma.rn.f32 $1, d1, s0, $1;",
                  "fma.rn.f32 $2, d2, s8, $2;", "fma.rn.f32 $3, d3, s8, $3;"]
    lines.append("}")
    return "\n".join(lines)


@functools.cache
def _pipe_asm(f16: bool, hint: bool, ahead: bool = False) -> str:
    """PTX of one loop step of the pipelined launch (`MmaGemv.pipe`; groups of 128, one a step):
    the NEXT step's weight words and scales / zeros are loaded first into outputs (consumed by the
    next step, not here: their DRAM latency runs under this step's arithmetic), then this step's x
    (pinned by the `early` predicate), then this step's arithmetic on the words and scales the
    previous step loaded (inputs). Operands: $0..$3 sums out (f); $4..$11 next words out (r);
    $12..$15 next s(g), s(g+8), z(g), z(g+8) out (r); $16 this step's x (l); $17 the next words
    (l); $18 / $19 the next scale / zero (l); $20 M (r); $21..$24 sums in (f); $25..$32 this step's
    words (r); $33..$36 its scales / zeros (r); then (r) whether there is a next step (the last
    step loads nothing). ahead: first, an L2 prefetch of the words at $37 (l: `MmaGemv.ahead` steps
    past the next one; the flag is then $38), so the next step's loads find them in L2."""
    magic = "0x64006400" if f16 else "0x43004300"
    one = "0x3C003C00" if f16 else "0x3F803F80"
    big = "0f44800000" if f16 else "0f43000000"
    ty = "f16" if f16 else "bf16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    more = "$38" if ahead else "$37"
    lines = ["{", ".reg .b32 u, sh, one2, nz0, nz8, p0, p1, p2, p3, dep;", ".reg .b16 h0;", ".reg .pred pa, pz, pn;",
             ".reg .f32 d0, d1, d2, d3, s0, s8, z0, z8;", ".reg .b32 x<16>;",
             f"mov.b32 one2, {one};", "mov.f32 $0, $21;", "mov.f32 $1, $22;", "mov.f32 $2, $23;", "mov.f32 $3, $24;"]
    if ahead:
        lines += ["prefetch.global.L2 [$37];", "prefetch.global.L2 [$37+512];"]
    lines += [f"setp.ne.u32 pn, {more}, 0;",
              f"@pn {_ld_pinned(hint)} {{$4, $5, $6, $7}}, [$17];", f"@pn {_ld_pinned(hint)} {{$8, $9, $10, $11}}, [$17+512];",
              "@pn ld.global.u16 $12, [$18];", "@pn ld.global.u16 $13, [$18+16];",
              "@pn ld.global.u16 $14, [$19];", "@pn ld.global.u16 $15, [$19+16];", "bar.warp.sync -1;"]
    for t in range(2):
        for half in range(2):
            regs = ", ".join(f"x{8 * t + 4 * half + i}" for i in range(4))
            lines.append(f"ld.global.v4.b32 {{{regs}}}, [$16+{128 * t + 16 * half}];")
    lines += ["lop3.b32 dep, x0, x4, x8, 0x96;", "xor.b32 dep, dep, x12;", "setp.eq.u32 pa, $20, 0;",
              "setp.eq.and.u32 pz, dep, 0, pa;", "@pz mov.f32 $0, 0f7FC00000;"]
    for reg, src in (("s0", 33), ("s8", 34), ("z0", 35), ("z8", 36)):
        if f16:
            lines += [f"cvt.u16.u32 h0, ${src};", f"cvt.f32.f16 {reg}, h0;"]
        else:
            lines += [f"shl.b32 u, ${src}, 16;", f"mov.b32 {reg}, u;"]
    for z, nz in (("z0", "nz0"), ("z8", "nz8")):
        lines += [f"add.f32 {z}, {z}, {big};", f"neg.f32 {z}, {z};", f"cvt.rn.{ty}x2.f32 {nz}, {z}, {z};"]
    lines += [f"mov.f32 d{i}, 0f00000000;" for i in range(4)]
    for t in range(2):
        for m in range(4):
            w = f"${25 + 4 * t + m}"
            xb = f"{{x{8 * t + 2 * m}, x{8 * t + 2 * m + 1}}}"
            lines.append(f"lop3.b32 p0, {w}, 0x000F000F, {magic}, 0xEA;")
            for i, p in ((1, "p1"), (2, "p2"), (3, "p3")):
                lines += [f"shr.u32 sh, {w}, {4 * i};", f"lop3.b32 {p}, sh, 0x000F000F, {magic}, 0xEA;"]
            lines += [f"fma.rn.{ty}x2 p0, p0, one2, nz0;", f"fma.rn.{ty}x2 p1, p1, one2, nz8;",
                      f"fma.rn.{ty}x2 p2, p2, one2, nz0;", f"fma.rn.{ty}x2 p3, p3, one2, nz8;",
                      f"{mma} {{d0, d1, d2, d3}}, {{p0, p1, p2, p3}}, {xb}, {{d0, d1, d2, d3}};"]
    lines += ["fma.rn.f32 $0, d0, s0, $0;", "fma.rn.f32 $1, d1, s0, $1;",
              "fma.rn.f32 $2, d2, s8, $2;", "fma.rn.f32 $3, d3, s8, $3;", "}"]
    return "\n".join(lines)


@functools.cache
def _pipe_first_asm(hint: bool) -> str:
    """PTX of the pipelined launch's first loads (constant data: before the PDL wait): $0..$7 the
    first step's words, $8..$11 its scales / zeros (r), from $12 words, $13 scale, $14 zero (l)."""
    return "\n".join([f"{_ld_pinned(hint)} {{$0, $1, $2, $3}}, [$12];", f"{_ld_pinned(hint)} {{$4, $5, $6, $7}}, [$12+512];",
                      "ld.global.u16 $8, [$13];", "ld.global.u16 $9, [$13+16];",
                      "ld.global.u16 $10, [$14];", "ld.global.u16 $11, [$14+16];", "bar.warp.sync -1;"])


@triton.jit
def _pipe_loop(ASM_FIRST: tl.constexpr, ASM_PIPE: tl.constexpr, w_thr, x_thr, s_thr, z_thr, g_lo, per, one, s_sg, M,
               USE_PDL: tl.constexpr, AHEAD: tl.constexpr, res_ptr, nw_ptr, x_ptr, K, s_rm, s_xm, inv_n, eps,
               GROUP: tl.constexpr, NORM: tl.constexpr, KB: tl.constexpr, sq_ptr, nparts, SQ: tl.constexpr):
    """The pipelined launch's K loop (`_pipe_asm`): the first step's words and scales loaded before
    the PDL wait, then each step loads the next one's while it computes its own (the last step
    loads nothing; its address stays in the slice). NORM: x normalized first (`_norm_rows`)."""
    z = tl.zeros([1], dtype=tl.float32)
    w0, w1, w2, w3, w4, w5, w6, w7, c0, c1, c2, c3 = tl.inline_asm_elementwise(
        ASM_FIRST, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,l,l",
        [(w_thr + g_lo * 256).to(tl.int64), (s_thr + g_lo * s_sg).to(tl.int64), (z_thr + g_lo * s_sg).to(tl.int64)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
               tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    if NORM:
        _norm_rows(res_ptr, nw_ptr, x_ptr, M, K, s_rm, s_xm, g_lo * GROUP, (g_lo + per) * GROUP, inv_n, eps, KB,
                   sq_ptr, nparts, SQ)
    a0, a1, a2, a3 = z, z, z, z
    for grp in range(g_lo, g_lo + per):
        nxt = tl.minimum(grp + 1, g_lo + per - 1)
        if AHEAD > 0:  # (spelled out: the operand list is a constexpr of the call)
            a0, a1, a2, a3, w0, w1, w2, w3, w4, w5, w6, w7, c0, c1, c2, c3 = tl.inline_asm_elementwise(
                ASM_PIPE, "=f,=f,=f,=f,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,l,l,l,l,r,f,f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,l,r",
                [(x_thr + grp * 128).to(tl.int64), (w_thr + nxt * 256).to(tl.int64), (s_thr + nxt * s_sg).to(tl.int64),
                 (z_thr + nxt * s_sg).to(tl.int64), one + M, a0, a1, a2, a3, w0, w1, w2, w3, w4, w5, w6, w7, c0, c1, c2,
                 c3, (w_thr + tl.minimum(grp + 1 + AHEAD, g_lo + per - 1) * 256).to(tl.int64), one + (grp + 1 < g_lo + per).to(tl.int32)],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.int32, tl.int32, tl.int32, tl.int32,
                       tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        else:
            a0, a1, a2, a3, w0, w1, w2, w3, w4, w5, w6, w7, c0, c1, c2, c3 = tl.inline_asm_elementwise(
                # early-clobber outputs ("=&r"): written before the inputs are read, never the same registers
                ASM_PIPE, "=f,=f,=f,=f,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,l,l,l,l,r,f,f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [(x_thr + grp * 128).to(tl.int64), (w_thr + nxt * 256).to(tl.int64), (s_thr + nxt * s_sg).to(tl.int64),
                 (z_thr + nxt * s_sg).to(tl.int64), one + M, a0, a1, a2, a3, w0, w1, w2, w3, w4, w5, w6, w7, c0, c1, c2, c3,
                 one + (grp + 1 < g_lo + per).to(tl.int32)],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.int32, tl.int32, tl.int32, tl.int32,
                       tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
    return a0, a1, a2, a3


def _ld_pinned(hint: bool) -> str:
    """A weight-word load ptxas keeps where it is written when a `bar.warp.sync` follows it: not
    `.nc` (ptxas moves those across loop iterations to just before their first use)."""
    return ("ld.global.L1::no_allocate.L2::256B" if hint else "ld.global") + ".v4.b32"


def _ld_words(hint: bool) -> str:
    return ("ld.global.nc.L1::no_allocate.L2::256B" if hint else "ld.global.nc") + ".v4.b32"


def _preload_asm(steps: int, hint: bool) -> str:
    """PTX loading the thread's weight words of STEPS K steps into $0 .. $(4 STEPS - 1) from the
    address operand after them (l): the first loop step's, issued before the PDL wait (constant data)."""
    n = 4 * steps
    return "\n".join(f"{_ld_words(hint)} {{${4 * t}, ${4 * t + 1}, ${4 * t + 2}, ${4 * t + 3}}}, [${n}+{512 * t}];"
                     for t in range(steps))


def _prefetch_asm(steps: int, level: str) -> str:
    """PTX prefetching (into `level`) the thread's words of one loop step (STEPS K steps) at $1
    (l); $0 a dummy output."""
    return "\n".join([f"prefetch.global.{level} [$1+{512 * t}];" for t in range(steps)] + ["mov.b32 $0, 0;"])


def _store_asm(f32: bool, f16: bool) -> str:
    """PTX storing the thread's four sums: $0 (dummy out), $1 the destination at the CTA's first
    channel (l), $2 bytes between rows (r), $3 M (r), $4..$7 the sums (f). f32: float32 stores
    (split-K partials), else rounded to bf16 / fp16. Then a fence: the CTA counts itself in
    after every thread's stores are visible at GPU scope."""
    esz = 4 if f32 else 2
    lines = ["{", ".reg .pred pr;", ".reg .b32 tid, wid, lane, g, j, r, c, cc;", ".reg .b64 a, o64;", ".reg .b16 hv;",
             "mov.u32 tid, %tid.x;", "shr.u32 wid, tid, 5;", "and.b32 lane, tid, 31;", "shr.u32 g, lane, 2;",
             "and.b32 j, lane, 3;", "shl.b32 c, wid, 4;", "add.u32 c, c, g;"]
    for i, (dr, dc) in enumerate(((0, 0), (1, 0), (0, 8), (1, 8))):  # (row 2j + dr, channel g + dc)
        lines += ["shl.b32 r, j, 1;", f"add.u32 r, r, {dr};", "setp.lt.u32 pr, r, $3;", "mul.wide.u32 a, r, $2;",
                  f"add.u32 cc, c, {dc};", f"mul.wide.u32 o64, cc, {esz};", "add.s64 a, a, o64;", "add.s64 a, a, $1;"]
        if f32:
            lines.append(f"@pr st.global.f32 [a], ${4 + i};")
        else:
            lines += [f"cvt.rn.{'f16' if f16 else 'bf16'}.f32 hv, ${4 + i};", "@pr st.global.b16 [a], hv;"]
    lines += ["fence.acq_rel.gpu;", "mov.b32 $0, 0;", "}"]
    return "\n".join(lines)


@functools.cache
def _store_pair_asm(f16: bool) -> str:
    """PTX storing the thread's two SiLU-and-mul products (`SILU`): $0 (dummy out), $1 the product
    tensor at the CTA's first product channel (l), $2 bytes between rows (r), $3 M (r), $4 / $5
    rows 2j / 2j + 1 of product channel 8 wid + g (f), rounded to bf16 / fp16."""
    lines = ["{", ".reg .pred pr;", ".reg .b32 tid, wid, lane, g, j, r, c;", ".reg .b64 a, o64;", ".reg .b16 hv;",
             "mov.u32 tid, %tid.x;", "shr.u32 wid, tid, 5;", "and.b32 lane, tid, 31;", "shr.u32 g, lane, 2;",
             "and.b32 j, lane, 3;", "shl.b32 c, wid, 3;", "add.u32 c, c, g;"]
    for dr in range(2):
        lines += ["shl.b32 r, j, 1;", f"add.u32 r, r, {dr};", "setp.lt.u32 pr, r, $3;", "mul.wide.u32 a, r, $2;",
                  "mul.wide.u32 o64, c, 2;", "add.s64 a, a, o64;", "add.s64 a, a, $1;",
                  f"cvt.rn.{'f16' if f16 else 'bf16'}.f32 hv, ${4 + dr};", "@pr st.global.b16 [a], hv;"]
    lines += ["mov.b32 $0, 0;", "}"]
    return "\n".join(lines)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up with the roundings of the unfused path: the GEMV's float32 sums rounded to
    the activation dtype, then `silu_and_mul`'s kernel arithmetic (its silu rounded once more)."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return silu * up.to(dtype).to(tl.float32)


@triton.jit
def _ref_sums(x_ptr, w_ptr, s_ptr, z_ptr, cols, g_lo, per, M, K, s_xm, s_sg, GROUP: tl.constexpr):
    """The interpreter's sums [8 rows, cols] over groups g_lo .. g_lo + per: codes gathered by the
    inverse index map (`_codes_at`), float32."""
    rows = tl.arange(0, 8)
    kk = tl.arange(0, GROUP)
    acc = tl.zeros([8, cols.shape[0]], dtype=tl.float32)
    for grp in range(g_lo, g_lo + per):
        k = grp * GROUP + kk
        q = _codes_at(w_ptr, k[:, None], cols[None, :], K).to(tl.float32)
        z = tl.load(z_ptr + grp * s_sg + cols).to(tl.float32)
        s = tl.load(s_ptr + grp * s_sg + cols).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * s_xm + k[None, :], mask=rows[:, None] < M, other=0.0).to(tl.float32)
        d = tl.sum(x[:, :, None] * (q - z[None, :])[None, :, :], axis=1)
        acc += d * s[None, :]
    return acc


@triton.jit
def _codes_at(w_ptr, k, n, K):
    """The codes [k.shape x n.shape] of input channels k ([BK, 1]) and outputs n ([1, BN]) in the
    mma layout (the inverse of `int4_packing.to_mma`'s index map). The word index and the nibble
    are sums of a part of k and a part of n (computed once per row and per column):
    word = (n // 16) (K / 64) 128 + 16 g + [128 (k // 64) + 4 j + m], nibble = (n % 16) // 8 +
    [2 (off // 2) + 4 (off % 2)], with g = n % 8, j = (k % 64) // 16, m = (k % 16) // 4, off = k % 4."""
    off = k % 4
    k_word = (k // 64) * 128 + ((k % 64) // 16) * 4 + (k % 16) // 4
    k_shift = 8 * (off // 2) + 16 * (off % 2)
    n_word = (n // 16).to(tl.int64) * (K // 64) * 128 + 16 * (n % 8)
    n_shift = 4 * ((n % 16) // 8)
    return (tl.load(w_ptr + (n_word + k_word)) >> (n_shift + k_shift)) & 0xF


@triton.jit
def _first_step(ASM_PRE: tl.constexpr, ASM_STEP_IN: tl.constexpr, w_thr, x_thr, s_thr, z_thr, g_lo, one, s_sg, M,
                STEPS: tl.constexpr, SPG: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    """The first loop step under PDL: its weight words loaded, then the wait, then its sums (from
    0). Spelled out per STEPS: Triton 3.6 neither multiplies strings nor binds dtype tuples in a kernel."""
    z = tl.zeros([1], dtype=tl.float32)
    w0_ = (w_thr + g_lo * (SPG * 128)).to(tl.int64)
    x0_ = (x_thr + g_lo * GROUP).to(tl.int64)
    s0_ = (s_thr + g_lo * s_sg).to(tl.int64)
    z0_ = (z_thr + g_lo * s_sg).to(tl.int64)
    if STEPS == 1:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            ASM_PRE, "=r,=r,=r,=r,l", [w0_], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        pdl.launch_dependents(USE_PDL)
        pdl.wait(USE_PDL)
        return tl.inline_asm_elementwise(
            ASM_STEP_IN, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f,r,r,r,r",
            [w0_, x0_, s0_, z0_, one + s_sg * 2, one + M, z, z, z, z, w0, w1, w2, w3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
    elif STEPS == 2:
        w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
            ASM_PRE, "=r,=r,=r,=r,=r,=r,=r,=r,l", [w0_],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        pdl.launch_dependents(USE_PDL)
        pdl.wait(USE_PDL)
        return tl.inline_asm_elementwise(
            ASM_STEP_IN, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f,r,r,r,r,r,r,r,r",
            [w0_, x0_, s0_, z0_, one + s_sg * 2, one + M, z, z, z, z, w0, w1, w2, w3, w4, w5, w6, w7],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
    else:
        tl.static_assert(STEPS == 4, "a first step preloads 1, 2 or 4 K steps of words")
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = tl.inline_asm_elementwise(
            ASM_PRE, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l", [w0_],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                   tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        pdl.launch_dependents(USE_PDL)
        pdl.wait(USE_PDL)
        return tl.inline_asm_elementwise(
            ASM_STEP_IN, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0_, x0_, s0_, z0_, one + s_sg * 2, one + M, z, z, z, z, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11,
             w12, w13, w14, w15],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)


@triton.jit
def _mma_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_sg,
                     GROUP: tl.constexpr, SPLIT: tl.constexpr, WARPS: tl.constexpr, GPC: tl.constexpr,
                     ASM: tl.constexpr, ASM_SETUP: tl.constexpr, ASM_STEP: tl.constexpr, ASM_STORE: tl.constexpr, ASM_STORE_F32: tl.constexpr,
                     USE_PDL: tl.constexpr = False, ASM_PRE: tl.constexpr = "", ASM_STEP_IN: tl.constexpr = "",
                     AHEAD: tl.constexpr = 0, ASM_PF: tl.constexpr = "", RING: tl.constexpr = 0,
                     SILU: tl.constexpr = False, ASM_STORE_PAIR: tl.constexpr = "", ASM_PIPE: tl.constexpr = "",
                     ASM_FIRST: tl.constexpr = "", res_ptr=None, nw_ptr=None, s_rm=0, inv_n=0.0, eps=0.0,
                     NORM: tl.constexpr = False, KB: tl.constexpr = 1, RES: tl.constexpr = False, sq_ptr=None,
                     nparts=0, SQ: tl.constexpr = False, y_ptr=None, YW: tl.constexpr = False,
                     RSTD: tl.constexpr = False):
    """USE_PDL (`pdl`): signal dependents, then wait for x's producer before the first read of
    anything another kernel writes (x, partials, counters, out). ASM_PRE: the first loop step's
    weight words (constant) are loaded before that wait, and ASM_STEP_IN computes that step from
    them: under PDL the GEMV streams while the kernel before it finishes. AHEAD > 0: ASM_STEP
    prefetches the words AHEAD loop steps on (`_asm`'s ahead); with ASM_PRE, ASM_PF prefetches
    the AHEAD steps after the first before the wait (`_prefetch_asm`).
    SILU (`int4_packing.gate_up_pairs`: channels g / g + 8 of each 16-channel block are gate / up
    of one product channel): out is [M, N / 2], silu(gate) * up (`_silu_mul`), written by the
    thread that holds both sums (ASM_STORE_PAIR) or by the split-K epilogue.
    ASM_PIPE (`_pipe_loop`): the K loop loads each next step's words while computing the current one.
    NORM (`_norm_rows`, not with ASM_PRE): x_ptr is scratch [M, K] that each CTA first fills, for its
    K slice, with the RMSNorm (weight nw_ptr) of the float32 stream res_ptr: the norm kernel before
    the GEMV folded into it. RES (SPLIT > 1): the split-K epilogue adds the result, rounded to the
    activation dtype (the scales'), into the float32 stream res_ptr in place (out_ptr unused): the
    residual add of the norm after it, folded here. SQ with RES: each channel block also writes its
    rows' sums of squares of the new stream to sq_ptr [M, nparts] (column pid_n); SQ with NORM:
    the norm reads them there (`_norm_rows`). YW with RES and SQ: also y = (new stream * weight
    nw_ptr) in the activation dtype to y_ptr [M, N]. RSTD (SPLIT > 1): the split-K epilogue scales
    each row's result by rsqrt(sum of its sq_ptr partials * inv_n + eps) before rounding: with x = y,
    the GEMV of the RMSNorm of the stream, the norm's rstd applied after the GEMV (`mma_gemv`'s rstd_of)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BN: tl.constexpr = 16 * WARPS
    SPG: tl.constexpr = GROUP // 64
    per = K // GROUP // SPLIT  # the host checks that SPLIT divides the groups
    g_lo = pid_k * per
    n0 = pid_n * BN
    if ASM:
        one = tl.zeros([1], dtype=tl.int32)
        a0 = tl.zeros([1], dtype=tl.float32)
        a1 = tl.zeros([1], dtype=tl.float32)
        a2 = tl.zeros([1], dtype=tl.float32)
        a3 = tl.zeros([1], dtype=tl.float32)
        w_ofs, x_ofs, s_ofs = tl.inline_asm_elementwise(
            ASM_SETUP, "=l,=l,=l,r,r,r", [one + (K // 64) * 128, one + s_xm, one + M],
            dtype=(tl.int64, tl.int64, tl.int64), is_pure=True, pack=1)
        w_thr = w_ptr + (pid_n * WARPS).to(tl.int64) * (K // 64) * 128 + w_ofs
        x_thr = x_ptr + x_ofs
        s_thr = s_ptr + n0 + s_ofs
        z_thr = z_ptr + n0 + s_ofs
        if ASM_PIPE != "":  # the next step's words loaded under this step's arithmetic (`_pipe_asm`)
            a0, a1, a2, a3 = _pipe_loop(ASM_FIRST, ASM_PIPE, w_thr, x_thr, s_thr, z_thr, g_lo, per, one, s_sg, M,
                                        USE_PDL, AHEAD, res_ptr, nw_ptr, x_ptr, K, s_rm, s_xm, inv_n, eps, GROUP, NORM, KB,
                                        sq_ptr, nparts, SQ)
        else:
            g_first = g_lo
            if ASM_PRE != "":
                if ASM_PF != "":  # the AHEAD loop steps after the first prefetched too, before the wait
                    for j in tl.static_range(1, AHEAD + 1):
                        tl.inline_asm_elementwise(
                            ASM_PF, "=r,l", [(w_thr + tl.minimum(g_lo + j * GPC, g_lo + per - GPC) * (SPG * 128)).to(tl.int64)],
                            dtype=tl.int32, is_pure=False, pack=1)
                a0, a1, a2, a3 = _first_step(ASM_PRE, ASM_STEP_IN, w_thr, x_thr, s_thr, z_thr, g_lo, one, s_sg, M,
                                             SPG * GPC, SPG, GROUP, USE_PDL)
                g_first = g_lo + GPC
            else:
                pdl.launch_dependents(USE_PDL)
                pdl.wait(USE_PDL)
                if NORM:
                    _norm_rows(res_ptr, nw_ptr, x_ptr, M, K, s_rm, s_xm, g_lo * GROUP, (g_lo + per) * GROUP, inv_n, eps, KB,
                   sq_ptr, nparts, SQ)
            for grp in range(g_first, g_lo + per, GPC):
                if RING > 0:  # words through the shared-memory ring (`_asm`'s ring)
                    a0, a1, a2, a3 = tl.inline_asm_elementwise(
                        ASM_STEP, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f,l,r,r,r",
                        [(w_thr + grp * (SPG * 128)).to(tl.int64), (x_thr + grp * GROUP).to(tl.int64),
                         (s_thr + grp * s_sg).to(tl.int64), (z_thr + grp * s_sg).to(tl.int64),
                         one + s_sg * 2, one + M, a0, a1, a2, a3,
                         (w_thr + (grp * SPG + RING) * 128).to(tl.int64), one + ((g_lo + per - grp) * SPG - RING),
                         one + (grp == g_lo).to(tl.int32), one + ((grp - g_lo) * SPG) % RING],
                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
                elif AHEAD == 0:
                    a0, a1, a2, a3 = tl.inline_asm_elementwise(
                        ASM_STEP, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f",
                        # pointers as int64: Triton 3.6 refuses pointers of different element types in one asm
                        [(w_thr + grp * (SPG * 128)).to(tl.int64), (x_thr + grp * GROUP).to(tl.int64),
                         (s_thr + grp * s_sg).to(tl.int64), (z_thr + grp * s_sg).to(tl.int64),
                         one + s_sg * 2, one + M, a0, a1, a2, a3],
                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
                else:  # the words AHEAD steps on prefetched (the slice's last step at most: never past it)
                    a0, a1, a2, a3 = tl.inline_asm_elementwise(
                        ASM_STEP, "=f,=f,=f,=f,l,l,l,l,r,r,f,f,f,f,l",
                        [(w_thr + grp * (SPG * 128)).to(tl.int64), (x_thr + grp * GROUP).to(tl.int64),
                         (s_thr + grp * s_sg).to(tl.int64), (z_thr + grp * s_sg).to(tl.int64),
                         one + s_sg * 2, one + M, a0, a1, a2, a3,
                         (w_thr + tl.minimum(grp + AHEAD * GPC, g_lo + per - GPC) * (SPG * 128)).to(tl.int64)],
                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
        if SPLIT == 1 and SILU:
            dt: tl.constexpr = out_ptr.dtype.element_ty
            tl.inline_asm_elementwise(ASM_STORE_PAIR, "=r,l,r,r,f,f",
                                      [(out_ptr + n0 // 2 + one).to(tl.int64), one + N, one + M,
                                       _silu_mul(a0, a2, dt), _silu_mul(a1, a3, dt)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        elif SPLIT == 1:
            tl.inline_asm_elementwise(ASM_STORE, "=r,l,r,r,f,f,f,f",
                                      [(out_ptr + n0 + one).to(tl.int64), one + N * 2, one + M, a0, a1, a2, a3],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(ASM_STORE_F32, "=r,l,r,r,f,f,f,f",
                                      [(part_ptr + pid_k.to(tl.int64) * M * N + n0 + one).to(tl.int64), one + N * 4, one + M,
                                       a0, a1, a2, a3], dtype=tl.int32, is_pure=False, pack=1)
    else:  # the same sums in Triton ops (interpreter): codes gathered by the inverse index map
        pdl.launch_dependents(USE_PDL)
        pdl.wait(USE_PDL)
        if NORM:
            _norm_rows(res_ptr, nw_ptr, x_ptr, M, K, s_rm, s_xm, g_lo * GROUP, (g_lo + per) * GROUP, inv_n, eps, KB,
                   sq_ptr, nparts, SQ)
        rows = tl.arange(0, 8)
        if SILU:  # gate and up channels summed apart (`_ref_sums` is elementwise in the channels)
            c = tl.arange(0, BN // 2)
            gcols = n0 + 16 * (c // 8) + c % 8
            acc_g = _ref_sums(x_ptr, w_ptr, s_ptr, z_ptr, gcols, g_lo, per, M, K, s_xm, s_sg, GROUP)
            acc_u = _ref_sums(x_ptr, w_ptr, s_ptr, z_ptr, gcols + 8, g_lo, per, M, K, s_xm, s_sg, GROUP)
            mask = (rows[:, None] < M) & (gcols[None, :] < N)
            if SPLIT == 1:
                tl.store(out_ptr + rows[:, None] * (N // 2) + (n0 // 2 + c)[None, :],
                         _silu_mul(acc_g, acc_u, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=mask)
            else:
                base = part_ptr + pid_k.to(tl.int64) * M * N + rows[:, None] * N
                tl.store(base + gcols[None, :], acc_g, mask=mask)
                tl.store(base + gcols[None, :] + 8, acc_u, mask=mask)
        else:
            offs_n = n0 + tl.arange(0, BN)
            acc = _ref_sums(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, g_lo, per, M, K, s_xm, s_sg, GROUP)
            mask = (rows[:, None] < M) & (offs_n[None, :] < N)
            if SPLIT == 1:
                tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(part_ptr + pid_k.to(tl.int64) * M * N + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    if SPLIT > 1:
        tl.debug_barrier()  # every thread's partial is stored (and fenced) before the CTA counts itself in
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last slice of these channels: sum the partials in slice order
            rows = tl.arange(0, 8)
            if SILU:  # gate / up: channels g / g + 8 of each 16-channel block
                c = tl.arange(0, BN // 2)
                gcols = n0 + 16 * (c // 8) + c % 8
                mask = (rows[:, None] < M) & (gcols[None, :] < N)
                gate = tl.zeros([8, BN // 2], dtype=tl.float32)
                up = tl.zeros([8, BN // 2], dtype=tl.float32)
                for sl in range(SPLIT):
                    base = part_ptr + sl * M * N + rows[:, None] * N + gcols[None, :]
                    gate += tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
                    up += tl.load(base + 8, mask=mask, other=0.0, cache_modifier=".cg")
                if RSTD:
                    rstd = _rows_rstd(sq_ptr, nparts, M, inv_n, eps, KB)
                    gate *= rstd[:, None]
                    up *= rstd[:, None]
                tl.store(out_ptr + rows[:, None] * (N // 2) + (n0 // 2 + c)[None, :],
                         _silu_mul(gate, up, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=mask)
            else:
                offs_n = n0 + tl.arange(0, BN)
                mask = (rows[:, None] < M) & (offs_n[None, :] < N)
                total = tl.zeros([8, BN], dtype=tl.float32)
                for sl in range(SPLIT):
                    total += tl.load(part_ptr + sl * M * N + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                if RSTD:
                    total *= _rows_rstd(sq_ptr, nparts, M, inv_n, eps, KB)[:, None]
                if RES:  # the stream += the result (`int4_mma_fold._add_into_stream`)
                    _add_into_stream(total, rows, offs_n, mask, M, N, res_ptr, s_rm, sq_ptr, nparts, pid_n, y_ptr,
                                     nw_ptr, s_ptr.dtype.element_ty, SQ, YW)
                else:
                    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                             mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _mma_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, K, s_sg, s_on, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """W [N, K] in out's dtype from the mma layout (== int4_packing.dequantize of from_mma,
    transposed). A program takes ROWS consecutive 16-byte rows of the layout (a lane's four words
    of one K step: 16-byte loads) and writes the 16 consecutive inputs they hold of channels g and
    g + 8 (two 32-byte runs; 4 lanes of one g cover 64 consecutive inputs)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * 4 + tl.arange(0, 4)[None, :])  # [ROWS, 4 (m)]
    steps = K // 64
    lane = rows % 32
    n0 = (rows // (steps * 32)) * 16 + lane // 4
    k0 = ((rows // 32) % steps) * 64 + (lane % 4) * 16
    grp = (k0 // GROUP).to(tl.int64) * s_sg
    off = tl.arange(0, 4)  # input offset within a word's pair of pairs: nibble 2 (off // 2) + 4 (off % 2)
    shift = 8 * (off // 2) + 16 * (off % 2)
    cols = k0[:, None] + tl.arange(0, 16)[None, :]
    for hi in tl.static_range(2):  # channel g + 8 hi: nibbles one up
        q = ((words[:, :, None] >> (shift + 4 * hi)[None, None, :]) & 0xF).to(tl.float32)  # [ROWS, m, off]
        q = tl.reshape(q, (ROWS, 16))  # input 4 m + off
        n = n0 + 8 * hi
        sc = tl.load(s_ptr + grp + n).to(tl.float32)
        z = tl.load(z_ptr + grp + n).to(tl.float32)
        tl.store(out_ptr + n.to(tl.int64)[:, None] * s_on + cols, ((q - z[:, None]) * sc[:, None]).to(out_ptr.dtype.element_ty))


# Whether launches may take the pipelined loop (`MmaGemv.pipe`): `int4.mma_selftest` turns it off
# for the process where it fails on the device (the table's other launches then run without it).
PIPE_ENABLED = True


def config_for(n: int, k: int, group: int, sms: int = 132) -> MmaGemv:
    c = table().get((n, k)) or default_config(n, k, group, sms)
    if c.pipe and not PIPE_ENABLED:
        c = replace(c, pipe=False)
    return c if fits(n, k, group, c) else MmaGemv(warps=1, split=1)


@functools.cache
def _asm_texts(spg: int, gpc: int, f16: bool, early: bool = True, zmma: bool = False,
               hint: bool = False, ahead: str = "", ring: int = 0, warps: int = 4) -> tuple[str, str, str, str]:
    return (_setup_asm(), _asm(spg, gpc, f16, early, zmma, hint, ahead=ahead, ring=ring, warps=warps),
            _store_asm(False, f16), _store_asm(True, f16))


PRE_STEPS = (1, 2, 4)  # K steps of words a first step may preload (`_first_step`'s unpacking)


@functools.cache
def _pre_texts(spg: int, gpc: int, f16: bool, early: bool, zmma: bool, hint: bool) -> tuple[str, str]:
    """(ASM_PRE, ASM_STEP_IN) of a PDL launch preloading its first step; ("", "") where it cannot."""
    if spg * gpc not in PRE_STEPS:
        return "", ""
    return _preload_asm(spg * gpc, hint), _asm(spg, gpc, f16, early, zmma, hint, words_in=True)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def vector_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself where its rows may be read in 16-byte vectors (unit stride along K, the first row
    on a 16-byte boundary, rows a multiple of 16 bytes apart), else a contiguous copy."""
    if x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        return x.clone(memory_format=torch.contiguous_format)
    return x


def mma_gemv(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             c: MmaGemv | None = None, counters: torch.Tensor | None = None, silu: bool = False,
             norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
             sumsq: torch.Tensor | None = None, weighted: tuple[torch.Tensor, torch.Tensor] | None = None,
             rstd_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [M, K] (M <= 8) @ W^T -> [M, N] in x's dtype; W in the mma layout qm [N/16, K/64, 32, 4].
    c.split > 1 needs `counters` (zeroed int32, one per CTA: N / (16 c.warps)). silu: W's channels
    in `int4_packing.gate_up_pairs` order, and the result [M, N / 2] is silu(gate) * up (the
    kernel's `SILU`), as `silu_and_mul` of the plain GEMV's result in natural order.
    norm (weight [K], eps): x is the float32 residual stream, and the GEMV reads its RMSNorm in the
    scales' dtype (the kernel's NORM: `triton_ops.rms_norm(x, weight, eps, dtype)` then the GEMV,
    one launch). add_to (float32 [M, N], contiguous; split-K launches): the result, rounded to the
    scales' dtype, is added into it in place and it is returned (RES: `add_to += GEMV(x)`).
    sumsq (float32 [M, `sumsq_parts`], contiguous): with add_to, filled with partial sums of squares
    of the new stream's rows; with norm, those of x (a launch with add_to filled them since x last
    changed): the norm then reads them instead of a pass over the row (the kernel's SQ).
    weighted (y [M, N] in the scales' dtype, weight [N]; with add_to and sumsq): y = new stream *
    weight, rounded (YW). rstd_of (sumsq [M, parts] of x's stream, eps; split-K launches): each row's
    result times rsqrt(sum(sumsq[row]) / K + eps) (RSTD): with x = `weighted`'s y, the GEMV of the
    stream's RMSNorm (rounded once, as y, where the norm kernel rounds twice)."""
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    c = c or config_for(n, k, group)
    gpu = x.is_cuda and not _interpreting()
    act = scales.dtype if norm is not None else x.dtype
    if m > ROWS or qm.shape[1] * 64 != k or not fits(n, k, group, c):
        raise ValueError(f"int4 mma GEMV: x {tuple(x.shape)}, weight {tuple(qm.shape)}, group {group} do not fit "
                         f"{c.label()} (at most {ROWS} rows; K a multiple of 64 and of the group, a multiple of 64; "
                         f"SPLIT * GPC dividing the groups; N a multiple of 16 * WARPS)")
    if gpu and act not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4 mma GEMV: activations in bf16 or fp16 on a GPU, got {act}")
    if norm is not None and (x.dtype != torch.float32 or x.stride(1) != 1 or norm[0].shape != (k,)):
        raise ValueError(f"int4 mma GEMV: a folded norm reads a float32 stream [M, K] with unit stride and a weight "
                         f"[K], got {x.dtype} {tuple(x.stride())} and {tuple(norm[0].shape)}")
    if add_to is not None and (c.split == 1 or silu or add_to.dtype != torch.float32 or add_to.shape != (m, n)
                               or add_to.stride() != (n, 1)):
        raise ValueError(f"int4 mma GEMV: adding into the stream needs a split-K launch (got {c.label()}), no SiLU "
                         f"and a contiguous float32 [{m}, {n}] stream")
    ctas = n // (16 * c.warps)
    if (weighted is not None and (add_to is None or sumsq is None or weighted[0].shape != (m, n)
                                  or weighted[0].stride() != (n, 1) or weighted[1].shape != (n,))) or (
            rstd_of is not None and (c.split == 1 or norm is not None or rstd_of[0].dtype != torch.float32
                                     or rstd_of[0].shape[0] != m or rstd_of[0].stride() != (rstd_of[0].shape[1], 1))):
        raise ValueError(f"int4 mma GEMV: `weighted` needs add_to, sumsq, y [{m}, {n}] contiguous and a weight [{n}]; "
                         f"`rstd_of` a split-K launch (got {c.label()}), no norm, float32 sums [{m}, parts]")
    if sumsq is not None and ((norm is None) == (add_to is None) or sumsq.dtype != torch.float32 or sumsq.shape[0] != m
                              or sumsq.stride() != (sumsq.shape[1], 1) or (add_to is not None and sumsq.shape[1] != ctas)
                              or sumsq.shape[1] > 128 * c.warps):
        raise ValueError(f"int4 mma GEMV: sums of squares go with a norm or an add, float32 [{m}, parts] contiguous "
                         f"({ctas} parts for this add; at most {128 * c.warps} for a norm), got {tuple(sumsq.shape)}")
    if c.split > 1 and (counters is None or counters.numel() < ctas):
        raise ValueError(f"int4 mma GEMV: split {c.split} needs {ctas} zeroed counters")
    stream = x
    if norm is not None:  # the kernel writes each CTA's slice of the normalized rows here, then reads it
        x = torch.empty((m, k), dtype=act, device=x.device)
    x = vector_rows(x)
    out = add_to if add_to is not None else torch.empty((m, n // 2 if silu else n), dtype=x.dtype, device=x.device)
    part = torch.empty((c.split, m, n), dtype=torch.float32, device=x.device) if c.split > 1 else out
    f16 = x.dtype == torch.float16
    setup, step, store, store32 = _asm_texts(group // 64, c.gpc, f16, c.early, c.zmma, c.hint,
                                             ("L1" if c.ahead_l1 else "L2") if c.ahead and gpu else "",
                                             c.ring if gpu else 0, c.warps)
    launch = pdl.launch_kwargs(x.device) if c.pdl else {"USE_PDL": False}
    pre, step_in = (_pre_texts(group // 64, c.gpc, f16, c.early, c.zmma, c.hint)
                    if gpu and c.pre and not c.ring and not c.pipe and launch["USE_PDL"] and norm is None else ("", ""))
    fold = {}
    if norm is not None or add_to is not None:
        fold = {"res_ptr": stream if norm is not None else add_to, "s_rm": (stream if norm is not None else add_to).stride(0),
                "NORM": norm is not None, "RES": add_to is not None}
    if norm is not None:
        fold.update(nw_ptr=norm[0], inv_n=1.0 / k, eps=norm[1], KB=128 * c.warps)  # 4 values a thread
    if sumsq is not None:
        fold.update(sq_ptr=sumsq, nparts=sumsq.shape[1], SQ=True)
    if weighted is not None:
        fold.update(y_ptr=weighted[0], nw_ptr=weighted[1], YW=True)
    if rstd_of is not None:
        fold.update(sq_ptr=rstd_of[0], nparts=rstd_of[0].shape[1], inv_n=1.0 / k, eps=rstd_of[1], RSTD=True,
                    KB=triton.next_power_of_2(rstd_of[0].shape[1]))
    _mma_gemv_kernel[(ctas, c.split)](
        x, qm, scales, zeros, out, part, counters if c.split > 1 else out, m, n, k, x.stride(0), scales.stride(0),
        GROUP=group, SPLIT=c.split, WARPS=c.warps, GPC=c.gpc, ASM=gpu, ASM_SETUP=setup, ASM_STEP=step, ASM_STORE=store,
        ASM_STORE_F32=store32, ASM_PRE=pre, ASM_STEP_IN=step_in, AHEAD=c.ahead if gpu else 0, RING=c.ring if gpu else 0,
        ASM_PF=_prefetch_asm((group // 64) * c.gpc, "L1" if c.ahead_l1 else "L2") if pre and c.ahead else "",
        SILU=silu, ASM_STORE_PAIR=_store_pair_asm(f16) if gpu and silu else "",
        ASM_PIPE=_pipe_asm(f16, c.hint, c.ahead > 0) if gpu and c.pipe else "", ASM_FIRST=_pipe_first_asm(c.hint) if gpu and c.pipe else "",
        num_warps=c.warps, **launch, **fold, **({"maxnreg": c.maxnreg} if gpu and c.maxnreg else {}))
    return out


def sumsq_parts(n: int, k: int, group: int) -> int:
    """Columns of the sums of squares (`mma_gemv`'s sumsq) that an add launch of this weight writes."""
    return n // (16 * config_for(n, k, group).warps)


# Rows up to which `mma_matmul` runs the GEMV once per 8 rows (each launch reads the weight
# again); above, dequantize + cuBLAS. A guess until measured (a launch ~ the weight's read).
LOOP_MAX_ROWS = 32


def mma_dequantize(qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The mma layout back to W^T [K, N] in `dtype` (a transposed view of W [N, K]: the kernel
    writes rows of W contiguously; cuBLAS takes either)."""
    n, k = qm.shape[0] * 16, qm.shape[1] * 64
    group = k if group_size == -1 else group_size
    out = torch.empty((n, k), dtype=dtype, device=qm.device)
    rows = n * k // 32
    block = 256 if rows % 256 == 0 else 32  # rows is a multiple of 32 (16 outputs x 64 inputs / 32)
    _mma_dequant_kernel[(rows // block,)](qm, scales, zeros, out, k, scales.stride(0), out.stride(0), GROUP=group,
                                          ROWS=block, num_warps=4)
    return out.t()


def mma_matmul(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               counters: torch.Tensor | None = None, x_kperm: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T for any M: the GEMV up to 8 rows; above, a GEMM on this layout
    (`int4_wsa_route`, then `triton_int4_dot_gemm`) where its table lists the rows and shape, else
    the GEMV per 8 rows up to LOOP_MAX_ROWS, else dequantize + cuBLAS. x_kperm: x's
    columns already in the swapped GEMM's K order (`int4_kperm`): that GEMM reads it as it is,
    every other path after putting it back."""
    m = x.shape[0]
    n, k = qm.shape[0] * 16, qm.shape[1] * 64
    group = k if group_size == -1 else group_size
    if x_kperm:
        from tokenmill.layers.quantization import int4_kperm

        t = int4_kperm.swap_launch(m, n, k, group, x.dtype)  # the one table lookup of this call
        if t is not None:
            from tokenmill.layers.quantization import int4_wsa_route as wsa
            from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

            if isinstance(t, wsa.WsaTiles):  # the warp-specialized swapped GEMM (TOKENMILL_INT4_WSA_TABLE)
                return wsa.run(x, qm, scales, zeros, group_size, t, counters)
            return dot.run(x, qm, scales, zeros, group_size, t, counters, x_kperm=True)
        x = int4_kperm.unpermute(x)
    if m <= ROWS:
        return mma_gemv(x, qm, scales, zeros, group_size, counters=counters)
    from tokenmill.layers.quantization import int4_wsa_route as wsa

    atiles = wsa.wsa_tiles(m, n, k, group, x.dtype)
    if atiles is not None:  # listed for the wsa GEMM, x natural (no producer wrote it permuted): permute it
        from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

        return wsa.run(permute_x(x), qm, scales, zeros, group_size, atiles, counters)
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    dtiles = dot.dot_tiles(m, n, k, group, x.dtype)
    if dtiles is not None:  # the tl.dot / Gluon GEMM where its measured table lists the rows and shape
        return dot.run(x, qm, scales, zeros, group_size, dtiles, counters)
    if m <= LOOP_MAX_ROWS:
        return torch.cat([mma_gemv(x[i:i + ROWS], qm, scales, zeros, group_size, counters=counters)
                          for i in range(0, m, ROWS)])
    return x @ mma_dequantize(qm, scales, zeros, group_size, x.dtype)
