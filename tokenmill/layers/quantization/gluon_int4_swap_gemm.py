"""Gluon kernel (Hopper): the W4A16 GEMM with the dequantized weight as wgmma's register operand
(issue 22, 256 rows): out^T [N, M] = W [N, K] @ x^T, no shared-memory round trip for the weight.

Why: the Gluon GEMM of `gluon_int4_gemm` (x as A, the weight dequantized into shared memory as B)
spends each 64-input step in a serial chain (cp.async wait, barrier, the words' shared-memory
reads, dequantization, the B tile's store, fence, barrier, wgmma) and reaches 0.65x bf16 cuBLAS at
256 rows. Here the words go from global memory straight into registers (one 16-byte load per lane
and step, issued AHEAD steps early), are dequantized there into the wgmma A fragment, and the
wgmma reads only x from shared memory; the next step is dequantized while it runs.

Why it needs no repack: `int4_packing.to_mma`'s word m of lane (g, j) in a 64-input step is, nibble
pair (i, i + 4) by nibble pair, an m16n8k16 A fragment (registers a0..a3: channel g / g + 8 times
input pair 0-1 / 2-3 of 16 j + 4 m + 0..3), i.e. wgmma's register A operand for a K order that is
a permutation of the step's 64 inputs: logical 16 m + 8 a + 2 j + b is physical 16 j + 4 m + 2 a + b.
The wrapper gives the kernel x with its columns in that order (`permute_x`: one copy of x, 2 MB
at 256 rows of 4096 inputs), or (`SwapTiles.xnat`) the kernel gathers x as it is in 4-byte
cp.asyncs (an input pair b = 0, 1 stays contiguous) into that order; the sum over K does not change.

Dequantization (PTX, one word a call): nibbles i and i + 4 of the word ORed into 128.0's mantissa
as a bf16 pair (one `lop3`), (128 + q) - (128 + z) exact, times the scale rounded once: the same
weight as `triton_int4_dot_gemm`'s DEQ 2 and as dequantize-then-GEMM. bf16 only; split-K as
`gluon_int4_gemm`. GPUs only (Gluon has no interpreter): tests/layers/test_int4_swap_gemm.py
checks the K order and the fragment map on the CPU through `emulate` and compiles the kernel for
sm_90 offline; scripts/gpu_int4_gemm.py checks every launch against a float32 reference.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenmill.layers.quantization.gluon_int4_gemm import split_k_store
from tokenmill.layers.quantization.triton_int4_dot_gemm import (
    SwapTiles,
    _cached_scale_offset,
)

# cp.async of a tile: `async_copy_global_to_shared` in triton 3.6 (the GPU's), `async_load` from 3.7
# (the offline compile test runs whichever is installed)
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the CTA barrier: renamed in 3.7

# One word ($4; $5 the same word: pack=2 pairs an element with its copy) and the scale / -(128 + z)
# bf16 pairs of channel g ($6 scale, $8 offset) and g + 8 ($10, $12) -> $k: nibbles k, k + 4
# dequantized (a bf16 pair: the A fragment's register k).
_NIB = """lop3.b32 t, {src}, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, {z};
fma.rn.bf16x2 {out}, t, {s}, nz;
"""
_ASM_SWAP = gl.constexpr("{\n.reg .b32 t, one, nz;\nmov.b32 one, 0x3F803F80;\nmov.b32 nz, 0x80008000;\n" + "".join(
    (f"shr.u32 t, $4, {4 * k};\n" if k else "") + _NIB.format(src="t" if k else "$4", out=f"${k}",
                                                               s="$6" if k % 2 == 0 else "$10",
                                                               z="$8" if k % 2 == 0 else "$12")
    for k in range(4)) + "}")


# `_dequant`'s permute of [CB, S2, g, j, m, b, hi, a] to [CB, hi, g | S2, m, a, j, b]: A tile rows
# 16 cb + 8 hi + g, columns (logical K) 64 s2 + 16 m + 8 a + 2 j + b
A_ORDER = gl.constexpr((0, 6, 2, 1, 4, 7, 3, 5))


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 64-input step's columns in the weight fragment's K order: column
    16 m + 8 a + 2 j + b of a step holds input 16 j + 4 m + 2 a + b (a contiguous copy; on CUDA
    `triton_x_permute`'s one-pass kernel, else this view permute, its reference)."""
    m, k = x.shape
    if x.is_cuda and x.stride(1) == 1:
        from tokenmill.layers.quantization.triton_x_permute import permute_x_triton

        return permute_x_triton(x)
    return x.reshape(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)


def gather_columns(bk: int) -> torch.Tensor:
    """The input each logical column of a K tile reads when the kernel gathers x (`SwapTiles.xnat`):
    the CPU mirror of the kernel's offsets, checked against `permute_x`."""
    rk = torch.arange(bk)
    c = rk % 64
    p = c // 2
    return (rk // 64) * 64 + 2 * (8 * (p % 4) + 2 * (p // 8) + (p // 4) % 2) + c % 2


def scale_pairs(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The words `_pairs` makes in the kernel from packed scale / offset words (int64 values of the
    int32 bits): the scale twice, -(128 + z) twice (the CPU test feeds them to the emulated PTX)."""
    lo, hi = sz & 0xFFFF, (sz >> 16) & 0xFFFF
    return lo | (lo << 16), (hi | (hi << 16)) ^ 0x80008000


def fragment_tile(qm: torch.Tensor, step: int, block: int) -> torch.Tensor:
    """Codes (int64) of the [16, 64] A tile the kernel builds from 16-channel block `block`'s words
    in 64-input step `step`, in its logical K order: the CPU reference of the kernel's register map
    (element [8 hi + g, 16 m + 8 a + 2 j + b] from nibble (k, k + 4 b) of lane 4 g + j's word m,
    k = hi + 2 a)."""
    w = qm[block, step].to(torch.int64).view(8, 4, 4)  # g, j, m
    tile = torch.empty(16, 64, dtype=torch.int64)
    for k in range(4):
        hi, a = k % 2, k // 2
        for b in range(2):
            nib = (w >> (4 * (k + 4 * b))) & 0xF  # [g, j, m]
            for m in range(4):
                for j in range(4):
                    tile[8 * hi:8 * hi + 8, 16 * m + 8 * a + 2 * j + b] = nib[:, j, m]
    return tile


def emulate(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
            ) -> torch.Tensor:
    """The kernel's product in float64 from its parts: `fragment_tile` per block and step times
    `permute_x`'s columns (the CPU test's check of the K order and the register map)."""
    blocks, steps = qm.shape[:2]
    xp = permute_x(x).double()
    out = torch.zeros(x.shape[0], blocks * 16, dtype=torch.float64)
    for s in range(steps):
        g = s * 64 // group
        for cb in range(blocks):
            ch = slice(16 * cb, 16 * cb + 16)
            w = (fragment_tile(qm, s, cb).double() - zeros[g, ch].double()[:, None]) * scales[g, ch].double()[:, None]
            out[:, ch] += xp[:, 64 * s:64 * s + 64] @ w.t()
    return out


@gluon.jit
def _load_words(w_ptrs, sz_ptrs, step, N, BK: gl.constexpr, GROUP: gl.constexpr):
    """Step `step`'s words [CB, S2, 8, 4, 4] and its channels' packed scale / offset [CB, 8] (g, g + 8)."""
    grp = step * BK // GROUP
    return gl.load(w_ptrs + step * (BK // 64) * 128), gl.load(sz_ptrs + grp * N), gl.load(sz_ptrs + grp * N + 8)


@gluon.jit
def _pairs(sz, like):
    """Packed scale / (128 + z) words [CB, 8] -> the scale and -(128 + z) as bf16 pairs, broadcast to
    `like` (the words) and joined with themselves as the words are."""
    lo = sz & 0xFFFF
    s2 = lo | (lo << 16)
    hi = (sz >> 16) & 0xFFFF
    z2 = (hi | (hi << 16)) ^ -2147450880  # 0x80008000: both halves negated
    s2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(s2, 1), 3), 4)
    z2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(z2, 1), 3), 4)
    s2, _ = gl.broadcast(s2, like)
    z2, _ = gl.broadcast(z2, like)
    return gl.join(s2, s2), gl.join(z2, z2)


@gluon.jit
def _dequant(words, sz_lo, sz_hi, a_l: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr):
    """Words [CB, S2, 8 g, 4 j, 4 m] -> the A tile [BC, BK] in wgmma's register layout (logical K)."""
    w2 = gl.join(words, words)  # [CB, S2, g, j, m, 2]
    sl, zl = _pairs(sz_lo, words)
    sh, zh = _pairs(sz_hi, words)
    o0, o1, o2, o3 = gl.inline_asm_elementwise(_ASM_SWAP, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
                                               [w2, sl, zl, sh, zh], dtype=(gl.bfloat16,) * 4, is_pure=True,
                                               pack=2)
    v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [CB, S2, g, j, m, b, hi, a]
    # A_ORDER element by element: triton 3.6's permute takes no constexpr tuple
    v = gl.permute(v, (A_ORDER[0], A_ORDER[1], A_ORDER[2], A_ORDER[3], A_ORDER[4], A_ORDER[5], A_ORDER[6],
                       A_ORDER[7]))
    a = gl.reshape(v, (BC, BK))  # [cb hi g, s2 m a j b]
    return gl.convert_layout(a, a_l, assert_trivial=True)


@gluon.jit
def _issue_x(x_smem, x_ptrs, t_mask, step, slot, BK: gl.constexpr, x_ptr, XNAT: gl.constexpr):
    """Step `step`'s x tile into stage `slot` (x_ptrs: pointers, or with XNAT int32 offsets from x_ptr)."""
    if XNAT:
        _async_load(x_smem.index(slot), x_ptr + (x_ptrs + step * BK), mask=t_mask)
    else:
        _async_load(x_smem.index(slot), x_ptrs + step * BK, mask=t_mask)
    cp.commit_group()


@gluon.jit
def _step(i, acc, x_smem, x_ptrs, t_mask, w_ptrs, sz_ptrs, w, s0, last, N, x_ptr,
          a_l: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
          AHEAD: gl.constexpr, XNAT: gl.constexpr, WTOP: gl.constexpr):
    """Step i (of the slice from s0): its words (w[0]) dequantized while wgmma i - 1 runs, its wgmma
    left in flight once i - 1's is retired, the words of step i + AHEAD + 1 loaded (w: the words,
    scales and offsets of steps i .. i + AHEAD, each a (words, lo, hi) triple: the loads of AHEAD + 1
    steps in flight, a deeper register prefetch hides HBM's latency where a step is short), x of step
    i + STAGES - 2 issued into the stage wgmma i - 2 left (every warp retired it before the barrier).
    WTOP: wgmma i - 2 is retired at the top instead, after the barrier, so that no barrier waits for
    the other warpgroup's wgmma: the dequantization has both warpgroups' wgmma i - 1 to hide behind;
    x of step i + STAGES - 3 goes into the stage of i - 3."""
    if WTOP:
        cp.wait_group(STAGES - 4)  # step i's x landed (this thread's copies) ...
        _barrier()  # ... everyone's; every warp retired wgmma i - 3 (its stage is free)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # retire i - 2 (this set's last reader)
        _issue_x(x_smem, x_ptrs, t_mask, gl.minimum(s0 + i + STAGES - 3, last), (i + STAGES - 3) % STAGES, BK,
                 x_ptr, XNAT)
    else:
        cp.wait_group(STAGES - 3)  # step i's x landed (this thread's copies) ...
        _barrier()  # ... everyone's
    wa, la, ha = w[0]
    a = _dequant(wa, la, ha, a_l, BC, BK)
    nxt = _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + i + AHEAD + 1, last), N, BK, GROUP)
    if AHEAD == 4:
        w = (w[1], w[2], w[3], w[4], nxt)
    elif AHEAD == 3:
        w = (w[1], w[2], w[3], nxt)
    elif AHEAD == 2:
        w = (w[1], w[2], nxt)
    else:
        w = (w[1], nxt)
    acc = warpgroup_mma(a, x_smem.index(i % STAGES).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
    if WTOP:  # i - 1 and i stay in flight (the wait only hands the loop a tensor)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])
    else:  # retire i - 1, then refill the stage i - 2 left
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        _issue_x(x_smem, x_ptrs, t_mask, gl.minimum(s0 + i + STAGES - 2, last), (i + STAGES - 2) % STAGES, BK,
                 x_ptr, XNAT)
    return acc, w


@gluon.jit
def store_tile_t(acc, out_ptr, part_ptr, cnt_ptr, pid, pid_k, split, pid_c, pid_t, M, N, s_om, SPLIT_K: gl.constexpr):
    """The swapped GEMMs' epilogue (this one's and `gluon_int4_wsa_gemm`'s): the output tile acc^T
    ([BC channels, BT tokens] of out^T) at channel tile pid_c, token tile pid_t into out [M, N] (row
    stride s_om), tokens past M masked. SPLIT_K (CTA pid's slice pid_k of `split`):
    `gluon_int4_gemm.split_k_store`."""
    BC: gl.constexpr = acc.shape[0]
    BT: gl.constexpr = acc.shape[1]
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, gl.num_warps()], [0, 1])  # channels contiguous per thread
    accT = gl.convert_layout(acc, out_l)
    oc = pid_c * BC + gl.arange(0, BC, layout=gl.SliceLayout(1, out_l))
    ot = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    o_off = gl.expand_dims(oc, 1) + gl.expand_dims(ot.to(gl.int64) * s_om, 0)
    o_mask = gl.expand_dims(ot < M, 0)
    if SPLIT_K:
        p_off = gl.expand_dims(oc, 1) + gl.expand_dims(ot.to(gl.int64) * N, 0)
        split_k_store(accT, out_ptr, part_ptr, cnt_ptr, o_off, p_off, o_mask, pid, pid_k, split, M, N, out_l)
    else:
        gl.store(out_ptr + o_off, accT.to(gl.bfloat16), mask=o_mask)


@gluon.jit(do_not_specialize=["M"])  # one compile per launch serves every row count
def _swap_gemm_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_om,
                      GROUP: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                      AHEAD: gl.constexpr, SPLIT_K: gl.constexpr, XNAT: gl.constexpr, CPW: gl.constexpr,
                      WTOP: gl.constexpr):
    W: gl.constexpr = gl.num_warps()
    CB: gl.constexpr = CPW * W  # 16-channel blocks a CTA: warp w takes blocks w, w + W, ...
    BC: gl.constexpr = 16 * CB
    S2: gl.constexpr = BK // 64
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    split = gl.num_programs(1)
    tiles_t = gl.cdiv(M, BT)
    pid_t = pid % tiles_t  # the token tiles of one weight tile side by side: its words leave HBM once
    pid_c = pid // tiles_t

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    L4: gl.constexpr = gl.SliceLayout(4, w_ld)  # [CB, S2, 8, 4]
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [CB, S2, 8]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [CB, S2]
    sz_l: gl.constexpr = gl.SliceLayout(1, L3)  # [CB, 8]
    if XNAT:  # one row's 64 inputs a warp, a pair a lane: 4-byte cp.asyncs, one 128-byte line, no bank conflict
        x_ld: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [W, 1], [1, 0])
    else:
        x_ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK],
                                       gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16))

    # x tile pointers [BT, BK] (x already in the fragment's K order)
    rt = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, x_ld))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_ld))
    if XNAT:  # x as it is: logical column 16 m + 8 a + 2 j + b (pair p = 8 m + 4 a + j) reads input 16 j + 4 m + 2 a + b
        c = rk % 64
        p = c // 2
        rk = (rk // 64) * 64 + 2 * (8 * (p % 4) + 2 * (p // 8) + (p // 4) % 2) + c % 2
        # int32 offsets (the wrapper checks M x K < 2^31): 32 copies a thread, 64-bit pointers would spill
        x_ptrs = gl.expand_dims(rt * s_xm, 1) + gl.expand_dims(rk, 0)
    else:
        x_ptrs = x_ptr + gl.expand_dims(rt.to(gl.int64) * s_xm, 1) + gl.expand_dims(rk, 0)
    t_mask = gl.expand_dims(rt < M, 1)
    # word pointers [CB, S2, 8 g, 4 j, 4 m] of step 0: lane (g, j)'s 16 contiguous bytes
    cb = gl.arange(0, CB, layout=gl.SliceLayout(1, L2))
    s2 = gl.arange(0, S2, layout=gl.SliceLayout(0, L2))
    base2 = gl.expand_dims((pid_c * CB + cb).to(gl.int64) * ((K // 64) * 128), 1) + gl.expand_dims(s2 * 128, 0)
    g8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    base3 = gl.expand_dims(base2, 2) + gl.expand_dims(gl.expand_dims(g8 * 16, 0), 1)
    j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    base4 = gl.expand_dims(base3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(j4 * 4, 0), 1), 2)
    m4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w_ld)))))
    w_ptrs = w_ptr + gl.expand_dims(base4, 4) + \
        gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(m4, 0), 1), 2), 3)
    # packed scale / offset pointers [CB, 8]: channel 16 cb + g (+ 8 for the odd nibbles)
    scb = gl.arange(0, CB, layout=gl.SliceLayout(1, sz_l))
    sg = gl.arange(0, 8, layout=gl.SliceLayout(0, sz_l))
    sz_ptrs = sz_ptr + gl.expand_dims((pid_c * CB + scb) * 16, 1) + gl.expand_dims(sg, 0)

    n_k = K // BK // split  # steps per slice (the wrapper makes the split divide them, n_k even)
    s0 = pid_k * n_k
    last = s0 + n_k - 1
    for s in gl.static_range(STAGES - 2 - WTOP):  # x: STAGES - 2 (- 1) steps in flight, one read, one (two) retiring
        _issue_x(x_smem, x_ptrs, t_mask, gl.minimum(s0 + s, last), s, BK, x_ptr, XNAT)
    # the words, scales and offsets of steps 0 .. AHEAD (clamped to the slice: a short slice reloads
    # its last step, never reads past it)
    w0 = _load_words(w_ptrs, sz_ptrs, s0, N, BK, GROUP)
    w1 = _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 1, last), N, BK, GROUP)
    if AHEAD == 4:
        w = (w0, w1, _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 2, last), N, BK, GROUP),
             _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 3, last), N, BK, GROUP),
             _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 4, last), N, BK, GROUP))
    elif AHEAD == 3:
        w = (w0, w1, _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 2, last), N, BK, GROUP),
             _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 3, last), N, BK, GROUP))
    elif AHEAD == 2:
        w = (w0, w1, _load_words(w_ptrs, sz_ptrs, gl.minimum(s0 + 2, last), N, BK, GROUP))
    else:
        w = (w0, w1)
    acc = gl.zeros([BC, BT], gl.float32, layout=acc_l)
    # Steps 0 (peeled: the accumulator's last writer before the final wait is a wgmma on every
    # path), 1 .. n_k - 2 two a trip, n_k - 1: each call site dequantizes into registers of its
    # own, which the wgmma still in flight (the previous step's, another call site's) never reads.
    acc, w = _step(0, acc, x_smem, x_ptrs, t_mask, w_ptrs, sz_ptrs, w, s0, last, N,
                   x_ptr, a_l, BC, BK, GROUP, STAGES, AHEAD, XNAT, WTOP)
    for i in range(1, n_k - 1, 2):
        acc, w = _step(i, acc, x_smem, x_ptrs, t_mask, w_ptrs, sz_ptrs, w, s0, last, N,
                       x_ptr, a_l, BC, BK, GROUP, STAGES, AHEAD, XNAT, WTOP)
        acc, w = _step(i + 1, acc, x_smem, x_ptrs, t_mask, w_ptrs, sz_ptrs, w, s0, last, N,
                       x_ptr, a_l, BC, BK, GROUP, STAGES, AHEAD, XNAT, WTOP)
    acc, w = _step(n_k - 1, acc, x_smem, x_ptrs, t_mask, w_ptrs, sz_ptrs, w, s0, last, N,
                   x_ptr, a_l, BC, BK, GROUP, STAGES, AHEAD, XNAT, WTOP)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    cp.wait_group(0)

    store_tile_t(acc, out_ptr, part_ptr, cnt_ptr, pid, pid_k, split, pid_c, pid_t, M, N, s_om, SPLIT_K)


def swap_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              tiles: SwapTiles | None = None, sz: torch.Tensor | None = None,
              counters: torch.Tensor | None = None, x_kperm: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ W^T -> [M, N]; W in the mma layout, scales / zeros [G, N] bf16 (or `sz` from
    `triton_int4_dot_gemm.packed_scale_offset`). CUDA and bf16 only. tiles.split > 1: K cut into
    that many slices (the largest dividing the steps up to it), needs `counters` (zeroed int32, one
    per output tile; without them, or too few, no split). x_kperm: x's columns already in the K
    order the kernel reads (written so by its producer: `int4_kperm`), read as they are."""
    t = tiles or SwapTiles()
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    block_c = 16 * t.warps * t.cpw
    if x.dtype != torch.bfloat16 or n % block_c or t.block_k not in (64, 128) or group % t.block_k or k % group:
        raise ValueError(f"gluon int4 swap GEMM: bf16 x, N a multiple of {block_c}, K and the group of "
                         f"{t.block_k} (x {x.dtype}, N {n}, K {k}, group {group})")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if t.xnat and m * k >= 2 ** 31:
        raise ValueError(f"gluon int4 swap GEMM: x [{m}, {k}] too large for the gathered read's int32 offsets")
    if x_kperm and t.xnat:
        raise ValueError("gluon int4 swap GEMM: x in the fragment K order for the gathered read (xnat)")
    xp = x.contiguous() if t.xnat or x_kperm else permute_x(x)
    if sz is None:
        sz = _cached_scale_offset(scales, zeros)
    n_tiles = triton.cdiv(m, t.block_t) * (n // block_c)
    split = t.split if counters is not None and counters.numel() >= n_tiles else 1
    steps = k // t.block_k
    if steps % 2:
        raise ValueError(f"gluon int4 swap GEMM: K {k} must hold an even number of {t.block_k}-input steps")
    while steps % split or (steps // split) % 2:  # whole, even steps a slice
        split -= 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _swap_gemm_kernel[(n_tiles, split)](xp, qm, sz, out, part, counters if split > 1 else out, m, n, k, xp.stride(0),
                                        out.stride(0), GROUP=group, BT=t.block_t, BK=t.block_k, STAGES=t.stages,
                                        AHEAD=t.ahead, SPLIT_K=split > 1, XNAT=t.xnat, CPW=t.cpw, WTOP=int(t.wtop), num_warps=t.warps)
    return out

