"""Triton kernel: INT4 W4A16 GEMM for 64..1024 rows on the tensor-core GEMV's weight layout
(`int4_packing.to_mma`, one copy of each weight), x as the tensor cores' A operand and the
dequantized weight tile as B: out [M, N] = x [M, K] @ W^T, a plain `tl.dot` GEMM.

The aim (issue 22): INT4 at 256 rows not slower than bf16 cuBLAS, where dequantize + cuBLAS writes
and reads the weight in bf16 on every decode step (~2x bf16's time a layer).

Per K tile (BLOCK_K = 64 or 128: one or two of the layout's 64-input steps; a group holds whole
tiles, so the scale / zero load is one row a tile) the packed words of BLOCK_N channels are loaded
through the software pipeline (each 16-channel block's step is 512 contiguous bytes), spread into
[BLOCK_K, BLOCK_N] in registers and stored by Triton to shared memory for wgmma. The layout's
word m of lane (g, j) in a step holds nibble hi + 2 a + 4 b = input 16 j + 4 m + 2 a + b, channel
g + 8 hi (`to_mma`): a permute and reshape put them back in natural K order, so x is read as is.

Dequantization:
- DEQ 2 (16-bit activations on a GPU; inline PTX): two words at a time, their halves paired with
  `prmt` so that one `lop3` makes two codes' M + q in a 16-bit pair (M: 128.0 in bf16, 1024.0 in
  fp16, the nibble ORed into its mantissa), then two packed FMAs: (M + q) - (M + z), exact, times
  the scale, rounded once: the same weight as dequantize-then-GEMM, ~2 instructions a weight.
  Scales and zero points come packed in one int32 per (group, channel) (`packed_scale_offset`:
  scale bits low, M + z bits high), so their loads are 4-byte and pipelined.
- DEQ 1: the same arithmetic in Triton element by element (16-bit activations; the interpreter in fp16).
- DEQ 0: float32 (q - z) s (float32 activations, the interpreter).

Split-K (`triton_split_k.store_tile`) where the output tiles are fewer than the SMs (o, down, qkv).
Torch reference: `int4_packing.dequantize` (of `from_mma`) then a matmul.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.int4_mma_launch import GEMM_ROW_BUCKETS, gemm_row_bucket, parse_gemm_table
from tokenmill.layers.quantization.triton_split_k import store_tile

# (magic bits of 128.0 or 1024.0 in the 16-bit dtype, its value) per activation dtype for DEQ 1 / 2
_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}

# Two words ($8, $9: consecutive elements of the word tile) and their channels' packed scale /
# offset words ($10, $11: channel g; $12, $13: channel g + 8) -> nibble i of both words as a
# 16-bit pair ($i, word $8's in the low half). {FMA}: fma.rn.bf16x2 or fma.rn.f16x2; {MAGIC2}
# the magic bits twice; {ONE2} 1.0 twice.
_DEQ_ASM = """{{
.reg .b32 lo, hi, sl, zl, sh, zh, t, one, nz;
mov.b32 one, {one2};
mov.b32 nz, 0x80008000;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
prmt.b32 sl, $10, $11, 0x5410;
prmt.b32 zl, $10, $11, 0x7632;
prmt.b32 sh, $12, $13, 0x5410;
prmt.b32 zh, $12, $13, 0x7632;
xor.b32 zl, zl, 0x80008000;
xor.b32 zh, zh, 0x80008000;
{body}}}"""


def _deq_asm(fma: str, magic2: int, one2: int) -> str:
    body = []
    for i in range(8):
        src = "lo" if i < 4 else "hi"
        s, z = ("sl", "zl") if i % 2 == 0 else ("sh", "zh")
        shift = 4 * (i % 4)
        if shift:
            body.append(f"shr.u32 t, {src}, {shift};")
            body.append(f"lop3.b32 t, t, 0x000F000F, {magic2:#x}, 0xEA;")
        else:
            body.append(f"lop3.b32 t, {src}, 0x000F000F, {magic2:#x}, 0xEA;")
        body.append(f"{fma} t, t, one, {z};")  # (M + q) - (M + z): exact
        body.append(f"{fma} ${i}, t, {s}, nz;")  # times the scale (+ -0.0), rounded once
    return _DEQ_ASM.format(body="\n".join(body) + "\n", one2=f"{one2:#x}")


_ASM_BF16 = tl.constexpr(_deq_asm("fma.rn.bf16x2", 0x43004300, 0x3F803F80))
_ASM_FP16 = tl.constexpr(_deq_asm("fma.rn.f16x2", 0x64006400, 0x3C003C00))


@triton.jit
def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
    """Eight tensors of one shape -> shape + [2, 2, 2]; [..., h, a, b] is o_{h + 2 a + 4 b}."""
    return tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))


@triton.jit(do_not_specialize=["M"])
def _dot_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sz_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_sg, s_om,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DEQ: tl.constexpr, BF16: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, GROUP_N: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    # GROUP_N weight tiles side by side over every row tile: each weight tile leaves HBM once
    per_group = GROUP_N * tiles_m
    pid_m = (pid % per_group) // GROUP_N
    pid_n = (pid // per_group) * GROUP_N + pid % GROUP_N
    CB: tl.constexpr = BLOCK_N // 16
    S2: tl.constexpr = BLOCK_K // 64
    dt = x_ptr.dtype.element_ty
    # the word tile [CB, S2, 8 g, 4 j, 4 m]: block cb's step s, lane 4 g + j, word m
    cb = pid_n * CB + tl.arange(0, CB)
    s2 = tl.arange(0, S2)
    g8 = tl.arange(0, 8)
    j4 = tl.arange(0, 4)
    w_off = (cb.to(tl.int64) * ((K // 64) * 128))[:, None, None, None, None] + (s2 * 128)[None, :, None, None, None] \
        + (g8 * 16)[None, None, :, None, None] + (j4 * 4)[None, None, None, :, None] \
        + j4[None, None, None, None, :]
    w_ptrs = w_ptr + w_off
    # each element's channels g and g + 8 of block cb: [CB, 1, 8, 1, 1]
    ch = ((pid_n * CB + tl.arange(0, CB)) * 16)[:, None, None, None, None] + g8[None, None, :, None, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_per_split = tl.cdiv(K // BLOCK_K, split) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = tl.load(w_ptrs + (k0 // 64) * 128)
        grp = k0 // GROUP
        if EVEN_M:
            x = tl.load(x_ptrs + k0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_mask, other=0.0)
        if DEQ == 2:
            sz_lo = tl.broadcast_to(tl.load(sz_ptr + grp * N + ch), (CB, S2, 8, 4, 4))
            sz_hi = tl.broadcast_to(tl.load(sz_ptr + grp * N + ch + 8), (CB, S2, 8, 4, 4))
            if BF16:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    _ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, sz_lo, sz_hi],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
            else:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    _ASM_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, sz_lo, sz_hi],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=2)
            v = _join8(o0, o1, o2, o3, o4, o5, o6, o7)  # [CB, S2, g, j, m, hi, a, b]
            w = tl.reshape(tl.permute(v, (1, 3, 4, 6, 7, 0, 5, 2)), (BLOCK_K, BLOCK_N))
        else:
            shifts = tl.arange(0, 8) * 4
            nib = (words[:, :, :, :, :, None] >> shifts[None, None, None, None, None, :]) & 0xF
            v = tl.reshape(nib, (CB, S2, 8, 4, 4, 2, 2, 2))  # [.., m, b, a, hi]: nibble hi + 2 a + 4 b
            codes = tl.reshape(tl.permute(v, (1, 3, 4, 6, 5, 0, 7, 2)), (BLOCK_K, BLOCK_N))
            s = tl.load(s_ptr + grp * s_sg + offs_n)
            z = tl.load(z_ptr + grp * s_sg + offs_n)
            if DEQ == 1:
                q = (codes | MAGIC).to(tl.int16).to(dt, bitcast=True)  # OFFSET + q, exact
                w = ((q - (OFFSET + z.to(tl.float32)).to(dt)[None, :]) * s[None, :]).to(dt)
            else:
                w = ((codes.to(tl.float32) - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]).to(dt)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, pid, pid_k, split, SPLIT_K)


@dataclass(frozen=True)
class DotTiles:
    """A launch: BLOCK_M rows of x by BLOCK_N weight channels per program, BLOCK_K inputs a step
    (64 or 128), warps, pipeline stages, split-K slices, GROUP_N weight tiles per row-tile sweep,
    deq 2 (the PTX dequantization) or 1 (Triton's elementwise)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 4
    stages: int = 4
    split: int = 1
    group_n: int = 1
    deq: int = 2

    def label(self) -> str:
        return (f"dot m{self.block_m} n{self.block_n} k{self.block_k} w{self.warps} st{self.stages}"
                f"{f' s{self.split}' if self.split > 1 else ''}{f' gn{self.group_n}' if self.group_n > 1 else ''}"
                f" deq{self.deq}")

    def code(self) -> str:
        return (f"DotTiles({self.block_m}, {self.block_n}, {self.block_k}, {self.warps}, {self.stages}, "
                f"{self.split}, {self.group_n}, {self.deq})")


@dataclass(frozen=True)
class GluonTiles:
    """A launch of the Gluon GEMM (`gluon_int4_gemm`; defined here so that tables name it without
    importing Gluon): BLOCK_M rows by BLOCK_N channels per CTA, cp.async stages, warps (4: one
    warpgroup), split-K slices."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    warps: int = 4
    split: int = 1
    block_k: int = 64  # one or two of the layout's 64-input steps a K tile

    def label(self) -> str:
        return (f"gluon m{self.block_m} n{self.block_n} st{self.stages} w{self.warps}"
                f"{f' s{self.split}' if self.split > 1 else ''}{' k128' if self.block_k == 128 else ''}")

    def code(self) -> str:
        return (f"GluonTiles({self.block_m}, {self.block_n}, {self.stages}, {self.warps}, {self.split}"
                f"{', 128' if self.block_k == 128 else ''})")


@dataclass(frozen=True)
class SwapTiles:
    """A launch of the swapped Gluon GEMM (`gluon_int4_swap_gemm`: the dequantized weight as wgmma's
    register A operand): BLOCK_T rows of x (wgmma's N: 8..256) by 16 x warps x cpw channels per CTA,
    cp.async stages of x (>= 3), split-K slices, inputs a K step (64 or 128), the words' register
    prefetch distance in steps (1 or 2), x gathered in the kernel (else permuted by a copy first)."""

    block_t: int = 256
    warps: int = 8
    stages: int = 4
    split: int = 1
    block_k: int = 64
    ahead: int = 2
    xnat: bool = False  # x read as it is, gathered into the K order in 4-byte copies (else permuted first)
    cpw: int = 1  # 16-channel blocks a warp (two: m64 twice a warpgroup, twice the channels a CTA)
    wtop: bool = False  # retire wgmma i - 2 after step i's barrier (no barrier waits on a wgmma; stages >= 4)

    @property
    def block_m(self) -> int:  # the rows of x a CTA takes, as the other launches name it
        return self.block_t

    @classmethod
    def parse(cls, label: str) -> SwapTiles:
        """The inverse of `label` ("swap t128 c128 w8 st5 s2 a3 wt")."""
        import re

        m = re.fullmatch(r"swap t(\d+) c(\d+) w(\d+) st(\d+)(?: s(\d+))?( k128)? a(\d+)( xn)?( wt)?", label.strip())
        if m is None:
            raise ValueError(f"not a swapped GEMM launch label: {label!r}")
        t, c, w, st, split, k128, ahead, xn, wt = m.groups()
        return cls(int(t), int(w), int(st), int(split or 1), 128 if k128 else 64, int(ahead), bool(xn),
                   int(c) // (16 * int(w)), bool(wt))

    def label(self) -> str:
        return (f"swap t{self.block_t} c{16 * self.warps * self.cpw} w{self.warps} st{self.stages}{f' s{self.split}' if self.split > 1 else ''}"
                f"{' k128' if self.block_k == 128 else ''} a{self.ahead}{' xn' if self.xnat else ''}{' wt' if self.wtop else ''}")

    def code(self) -> str:
        return (f"SwapTiles({self.block_t}, {self.warps}, {self.stages}, {self.split}, {self.block_k}, {self.ahead}"
                f"{f', {self.xnat}' if self.xnat or self.cpw > 1 or self.wtop else ''}"
                f"{f', {self.cpw}' if self.cpw > 1 or self.wtop else ''}{', True' if self.wtop else ''})")


# (rows bucket: the most rows it serves, N, K) -> the launch that measured fastest (Llama-8B's
# linears, `scripts/gpu_int4_gemm.py` INT4_GEMM_SET=swap): this GEMM (DotTiles), the Gluon one
# (GluonTiles) or the swapped Gluon one (SwapTiles, bf16); a shape or row count not listed takes the
# other paths of `triton_int4_mma.mma_matmul`. From session 8's mid-session sweep (one H200; us a
# call; in brackets the table before, i.e. session 7's Gluon / tl.dot launches or dequantize + cuBLAS,
# and bf16 cuBLAS, same process; docs/results/gpu-int4-gemm.md): only where >= 3% faster. 256 rows:
# the third round's sweep (x permuted by the Triton pass, more launches for down / qkv / o) moved qkv
# (37.6 -> 36.3 us); o stays on dequantize + cuBLAS (28.1 us against 29.0); 8192 rows (prefill):
# every swap launch lost to dequantize + cuBLAS.
TABLE: dict[tuple[int, int, int], DotTiles | GluonTiles | SwapTiles] = {
    (64, 28672, 4096): SwapTiles(64, 8, 4, 1, 64, 2),  # 47.3 us (74.2; bf16 66.3)
    (64, 4096, 14336): SwapTiles(64, 4, 5, 4, 64, 2, False, 1, True),  # 34.4 (41.7; 36.2)
    (64, 6144, 4096): SwapTiles(64, 4, 5, 4, 64, 2, False, 1, True),  # 19.4 (31.1; 16.7)
    (64, 4096, 4096): SwapTiles(64, 4, 4, 4, 64, 2, True),  # 16.4 (27.9; 12.1)
    (128, 28672, 4096): SwapTiles(128, 8, 4, 1, 64, 2),  # 71.1 (97.3; 67.7)
    (128, 4096, 14336): SwapTiles(128, 8, 4, 4, 64, 2, True),  # 47.0 (60.1; 37.8)
    (128, 6144, 4096): SwapTiles(128, 4, 4, 1, 64, 2),  # 28.3 (47.0; 16.9)
    (128, 4096, 4096): SwapTiles(128, 4, 4, 2, 64, 2),  # 24.5 (39.2; 15.0)
    (256, 28672, 4096): SwapTiles(256, 8, 4, 1, 64, 1),  # 103.3 (155.4; 90.9); third round 101.7 (89.9)
    (256, 4096, 14336): SwapTiles(256, 8, 5, 4, 64, 2, False, 1, True),  # 78.9 (93.6; 49.0); 73.8 (47.9)
    (256, 6144, 4096): SwapTiles(128, 8, 5, 1, 64, 2, False, 1, True),  # third round 36.3 (40.8; 22.6)
}


def table_override(text: str) -> dict[tuple[int, int, int], SwapTiles | None]:
    """TOKENMILL_INT4_GEMM_TABLE ("256,4096,14336=swap t128 c128 w8 st5 s2 a3 wt;256,4096,4096=none"):
    TABLE entries replaced by swapped-GEMM launches, or removed ("none": the other paths), for A/B
    runs of a sweep's winners without a commit."""
    return parse_gemm_table(text, lambda label: None if label.strip() == "none" else SwapTiles.parse(label))


for _key, _t in table_override(os.environ.get("TOKENMILL_INT4_GEMM_TABLE", "")).items():
    if _t is None:
        TABLE.pop(_key, None)
    else:
        TABLE[_key] = _t
BUCKETS = GEMM_ROW_BUCKETS
# False after a failed start-up self-test: every row count takes the other paths.
ENABLED = True


def dot_tiles(m: int, n: int, k: int, group: int, dtype: torch.dtype = torch.bfloat16
              ) -> DotTiles | GluonTiles | SwapTiles | None:
    """The launch for an [m, k] x [k, n] product on the mma layout, or None (another path)."""
    bucket = gemm_row_bucket(m)
    t = TABLE.get((bucket, n, k)) if bucket is not None and ENABLED else None
    if isinstance(t, GluonTiles):
        ok = dtype == torch.bfloat16 and n % t.block_n == 0 and group % t.block_k == 0 and k % group == 0
        return t if ok else None
    if isinstance(t, SwapTiles):
        ok = (dtype == torch.bfloat16 and n % (16 * t.warps * t.cpw) == 0 and group % t.block_k == 0 and k % group == 0
              and (k // t.block_k) % 2 == 0)
        return t if ok else None
    return t if t is not None and fits(n, k, group, t) else None


def run(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        tiles: DotTiles | GluonTiles | SwapTiles, counters: torch.Tensor | None = None,
        x_kperm: bool = False) -> torch.Tensor:
    """The launch `dot_tiles` chose: this module's GEMM or a Gluon one (x_kperm: x already in the
    swapped GEMM's K order; that GEMM only, without the gathered read)."""
    if x_kperm and not (isinstance(tiles, SwapTiles) and not tiles.xnat):
        raise ValueError(f"int4 GEMM: x in the swapped GEMM's K order for a launch that reads it natural "
                         f"({tiles.label()})")
    if isinstance(tiles, GluonTiles):
        from tokenmill.layers.quantization.gluon_int4_gemm import gluon_gemm

        return gluon_gemm(x, qm, scales, zeros, group_size, tiles, counters=counters)
    if isinstance(tiles, SwapTiles):
        from tokenmill.layers.quantization.gluon_int4_swap_gemm import swap_gemm

        return swap_gemm(x, qm, scales, zeros, group_size, tiles, counters=counters, x_kperm=x_kperm)
    return dot_gemm(x, qm, scales, zeros, group_size, tiles, counters)


def packed_scale_offset(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int32 [G, N] for DEQ 2: each channel's 16-bit scale in the low half, M + z (M: 128.0 in bf16,
    1024.0 in fp16; exact for the integer zero points every format stores) in the high half."""
    _, magic = _MAGIC16[scales.dtype]
    lo = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi = (zeros.float() + magic).to(scales.dtype).contiguous().view(torch.int16).to(torch.int32) << 16
    return lo | hi


def _cached_scale_offset(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """`packed_scale_offset` kept on the scales tensor (made on the first call outside a graph
    capture, e.g. the engine's warm-up; it lives as long as the layer's scales: +4 bytes per
    group and channel, the size of the scales and zeros together)."""
    sz = getattr(scales, "_int4_dot_sz", None)
    if sz is None:
        sz = packed_scale_offset(scales, zeros)
        if not (scales.is_cuda and torch.cuda.is_current_stream_capturing()):
            scales._int4_dot_sz = sz
    return sz


def keep_scale_offset(scales: torch.Tensor, zeros: torch.Tensor) -> None:
    """At load (outside any graph capture): the packed scales and offsets the GEMMs read, kept on
    the layer's scales where a table lists launches (a capture would otherwise pack them on every
    replay). +4 bytes per group and channel."""
    if TABLE and ENABLED and scales.is_cuda and scales.dtype in _MAGIC16:
        scales._int4_dot_sz = packed_scale_offset(scales, zeros)


def fits(n: int, k: int, group: int, t: DotTiles) -> bool:
    """The kernel takes a weight of N outputs, K inputs in the mma layout with these tiles."""
    return (t.block_k in (64, 128) and n % t.block_n == 0 and t.block_n % 16 == 0 and k % t.block_k == 0
            and group % t.block_k == 0 and k % group == 0)


def dot_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             tiles: DotTiles | None = None, counters: torch.Tensor | None = None,
             sz: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype; W in the mma layout qm [N/16, K/64, 32, 4], scales
    and zeros [G, N]. tiles.deq 2 needs 16-bit activations on a GPU (else deq 1 / 0 run) and the
    packed scales `sz` (`packed_scale_offset`, else packed here). tiles.split > 1: K cut into that
    many slices, needs `counters` (zeroed int32, one per output tile: `stream_tiles.SplitCounters`;
    without them, or too few, no split)."""
    t = tiles or DotTiles()
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    if qm.shape[1] * 64 != k or not fits(n, k, group, t):
        raise ValueError(f"int4 dot GEMM: x {tuple(x.shape)}, weight {tuple(qm.shape)}, group {group} do not fit "
                         f"{t.label()} (N a multiple of BLOCK_N, itself of 16; BLOCK_K 64 or 128 dividing the "
                         f"group, which divides K)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    magic, offset = _MAGIC16.get(x.dtype, (0, 0.0))
    deq = t.deq if x.dtype in _MAGIC16 else 0
    if deq == 2 and not x.is_cuda:
        deq = 1  # inline PTX: GPUs only
    if deq == 2 and sz is None:
        sz = _cached_scale_offset(scales, zeros)
    tiles_n = n // t.block_n
    group_n = max(1, min(t.group_n, tiles_n))
    while tiles_n % group_n:
        group_n -= 1
    n_tiles = tiles_n * triton.cdiv(m, t.block_m)
    split = t.split if counters is not None and counters.numel() >= n_tiles else 1
    split = max(1, min(split, k // t.block_k))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _dot_gemm_kernel[(n_tiles, split)](
        x, qm, scales, zeros, sz if deq == 2 else scales, out, part, counters if split > 1 else out, m, n, k,
        x.stride(0), scales.stride(0), out.stride(0), GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, DEQ=deq, BF16=x.dtype == torch.bfloat16, MAGIC=magic, OFFSET=offset,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_N=group_n, SPLIT_K=split > 1,
        EVEN_M=m % t.block_m == 0, num_warps=t.warps, num_stages=t.stages)
    return out
