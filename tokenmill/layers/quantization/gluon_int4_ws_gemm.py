"""Gluon kernel (Hopper): the W4A16 GEMM warp-specialized (issue 22, 256 rows): out [M, N] = x [M, K] @ W^T.

Why: every single-partition INT4 GEMM here (`gluon_int4_gemm`, `gluon_int4_swap_gemm`) spends each
64-input K step in one serial chain (x's copy wait, a CTA barrier, the dequantization, the wgmma
issue and retire, ~0.5 us) whatever the tile, so the tensor cores idle between steps. Here the
chain is cut into three partitions of one CTA that only meet at mbarriers of shared-memory rings:
- the loader (1 warp): per step, x's [BM, 64] tile, the step's words ([BN / 16, 128] int32 of the
  mma layout) and its group's packed scales / offsets ([1, BN]) by TMA (rows past M zero-filled),
  as soon as the consumers free the slots;
- the dequantizers (DEQ_WARPS warps): the words and scales from shared memory, dequantized
  (`triton_int4_dot_gemm`'s DEQ 2 PTX: the same weights as dequantize-then-GEMM) into the bf16
  [64, BN] B tile of a B ring. They never hold a global load in flight: the async-proxy fence
  before each ready signal waits for every outstanding load of the thread (session 10's first
  version loaded words into registers three steps ahead, and each fence waited for them: ~1 us a
  step);
- the consumer (the kernel's num_warps: one or two warpgroups) only waits for a slot's two ready
  barriers, issues its wgmma and, once the previous step's wgmma retired, frees that slot.
So the dequantization of step i + 1.. overlaps the wgmma of step i. Split-K (grid axis 1) for the
skinny linears, as `gluon_int4_gemm`: fp32 partials, the last slice to arrive sums them in order;
`gluon_int4_ws_streamk` runs the same partitions on a stream-K schedule. Same layout
(`int4_packing.to_mma`: [N / 16, K / 64, 32, 4] int32) and packed scales / offsets
(`packed_scale_offset`: [G, N] int32) as the other GEMMs. bf16 only; GPUs only (Gluon has no
interpreter): tests/layers/test_int4_ws_gemm.py checks the word -> B tile map and the split order on
the CPU and compiles the kernel for sm_90 offline; scripts/gpu_int4_ws.py checks it on the GPU
against a float32 reference. Torch reference: `int4_packing.dequantize` then a matmul.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tokenmill.layers.quantization.gluon_int4_gemm import _join8, store_tile
from tokenmill.layers.quantization.int4_ws_route import WsTiles
from tokenmill.layers.quantization.triton_int4_dot_gemm import (
    _ASM_BF16,
    _cached_scale_offset,
)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.7+: renamed
# memdesc reinterpret: `_reinterpret` in 3.6, `reinterpret` from 3.7 (a static branch in `_rings`)
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the barrier of the calling partition's warps (3.7: renamed)


# The dequantized words [CB, 1, g, j, m, hi, a, b] (block cb, lane (g, j), word m, nibble hi + 2 a + 4 b:
# input 16 j + 4 m + 2 a + b, channel 16 cb + 8 hi + g) -> the B tile [BK, BN] (TO_KN) or its transpose
# [BN, BK] (TO_NK), by permute + reshape (tests/layers/test_int4_ws_gemm.py checks both maps).
TO_KN = gl.constexpr((1, 3, 4, 6, 7, 0, 5, 2))
TO_NK = gl.constexpr((0, 5, 2, 1, 3, 4, 6, 7))
# kmajor 2: one word a lane -> 4 words of bf16 pairs [CB, 1, g, j, m, hi, a] (gl.join appends the new
# axis last: join(join(o0, o1), join(o2, o3))[..., hi, a] = o_{hi + 2 a}; pair (b = 0, 1): inputs
# 16 j + 4 m + 2 a + 0 / 1 of channel 16 cb + 8 hi + g) -> the K-major tile as int32 [BN, 32]
TO_NK_PAIRS = gl.constexpr((0, 5, 2, 1, 3, 4, 6))

# kmajor 2's dequantization, one word at a time ($4), every output register a pair of consecutive
# inputs (nibbles i and i + 4 of the word: the low and high half, so one lop3 takes both): outputs
# $0..$3 the pairs of nibbles (0, 4), (1, 5), (2, 6), (3, 7), i.e. (hi, a) = (0, 0), (1, 0), (0, 1),
# (1, 1); $5 / $6 channel g's scale twice / -(128 + its offset) twice, $7 / $8 channel g + 8's
# (`_ASM_PAIR_SZ`). The same operations as `_ASM_BF16` (DEQ 2) per weight, so the same bits: ((128 + q)
# - (128 + z)) exact, times the scale rounded once; without its two words' prmt pairing and the
# repacking into input pairs that the store needed after it.
_ASM_WORD = gl.constexpr("""{
.reg .b32 t, one, nz;
mov.b32 one, 0x3F803F80;
mov.b32 nz, 0x80008000;
lop3.b32 t, $4, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, $6;
fma.rn.bf16x2 $0, t, $5, nz;
shr.u32 t, $4, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, $8;
fma.rn.bf16x2 $1, t, $7, nz;
shr.u32 t, $4, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, $6;
fma.rn.bf16x2 $2, t, $5, nz;
shr.u32 t, $4, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, $8;
fma.rn.bf16x2 $3, t, $7, nz;
}""")
# a packed scale / offset word (scale low, 128 + offset high) -> (scale, scale), (-(128 + z), -(128 + z))
_ASM_PAIR_SZ = gl.constexpr("""{
.reg .b32 t;
prmt.b32 $0, $2, $2, 0x1010;
prmt.b32 t, $2, $2, 0x3232;
xor.b32 $1, t, 0x80008000;
}""")


# ----------------------------------------------------------------------------- partitions


@gluon.jit
def _clock():
    """The SM's cycle counter (PROBE timing only)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _b_operand(b_smem, s, KMAJOR: gl.constexpr):
    """Slot s of the B ring as the wgmma's [BK, BN] operand (a K-major slot viewed transposed)."""
    if KMAJOR:
        b = b_smem.index(s).permute((1, 0))
    else:
        b = b_smem.index(s)
    return b


@gluon.jit
def _consumer(x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, n_k, t_ptr, BM: gl.constexpr, BN: gl.constexpr,
              DIAG: gl.constexpr = 0, PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    """wgmma of step i on stage i % STAGES once both its tiles are ready; stage (i - 1) % STAGES
    freed once step i - 1's wgmma retired (one wgmma left in flight). DIAG 6 (timing only): no
    wgmma, each slot freed as soon as both its tiles are ready. PROBE: the cycles spent waiting for
    x, for B, in the wgmma issue + retire and at the release, summed over the steps, into
    t_ptr[16 pid + 8 ..]."""
    STAGES: gl.constexpr = x_smem.shape[0]
    num_warps: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
    t_start = _clock()
    q0 = t_start - t_start
    q1 = q0
    q2 = q0
    q3 = q0
    if DIAG == 6:
        for i in range(n_k):
            s = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(x_ready.index(s), ph)
            mbarrier.wait(b_ready.index(s), ph)
            _barrier()
            mbarrier.arrive(x_empty.index(s), count=1)
            mbarrier.arrive(b_empty.index(s), count=1)
    else:
        mbarrier.wait(x_ready.index(0), 0)
        mbarrier.wait(b_ready.index(0), 0)
        acc = warpgroup_mma(x_smem.index(0), _b_operand(b_smem, 0, KMAJOR), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # still in flight: a tensor again for the loop
        for i in range(1, n_k):
            s = i % STAGES
            ph = (i // STAGES) & 1
            if PROBE:
                c0 = _clock()
            mbarrier.wait(x_ready.index(s), ph)
            if PROBE:
                c1 = _clock()
            mbarrier.wait(b_ready.index(s), ph)
            if PROBE:
                c2 = _clock()
            acc = warpgroup_mma(x_smem.index(s), _b_operand(b_smem, s, KMAJOR), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if PROBE:
                c3 = _clock()
            _barrier()  # every warpgroup's wgmma i - 1 retired before its stage is handed back
            p = (i - 1) % STAGES
            mbarrier.arrive(x_empty.index(p), count=1)
            mbarrier.arrive(b_empty.index(p), count=1)
            if PROBE:
                c4 = _clock()
                q0 += c1 - c0
                q1 += c2 - c1
                q2 += c3 - c2
                q3 += c4 - c3
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    if PROBE:
        base = t_ptr + gl.program_id(0) * 16 + 8
        gl.store(base, q0)
        gl.store(base + 1, q1)
        gl.store(base + 2, q2)
        gl.store(base + 3, q3)
        gl.store(base + 7, _clock() - t_start)
    return (acc,)


@gluon.jit
def _load_in(i, k_step, off_m, off_cb, grp, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, x_ready, x_empty,
             w_ready, w_empty):
    """Ring step i (slot i % STAGES): x's [BM, 64] tile at K step k_step into the x ring, the step's
    words [CB, 128] and its group's packed scales [1, BN] into the word ring, each slot once freed."""
    STAGES: gl.constexpr = x_smem.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    s = i % STAGES
    ph = ((i // STAGES) & 1) ^ 1
    mbarrier.wait(x_empty.index(s), ph)
    mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
    _tma_load(x_desc, [off_m, k_step * BK], x_ready.index(s), x_smem.index(s))
    mbarrier.wait(w_empty.index(s), ph)
    mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    _tma_load(w_desc, [off_cb, k_step * 128], w_ready.index(s), w_smem.index(s))
    _tma_load(s_desc, [grp, off_cb * 16], w_ready.index(s), s_smem.index(s))


@gluon.jit
def _loader(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty, w_ready, w_empty,
            b_ready, b_empty, off_m, pid_n, s0, n_k, GROUP: gl.constexpr, PARTS: gl.constexpr, DIAG: gl.constexpr):
    """Each step's x tile, words and scales by TMA (the tiles' rows past M zero-filled)."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    for i in range(n_k):
        _load_in(i, s0 + i, off_m, pid_n * CB, ((s0 + i) * BK) // GROUP, x_desc, w_desc, s_desc, x_smem, w_smem,
                 s_smem, x_ready, x_empty, w_ready, w_empty)


@gluon.jit
def _dequant_tile(words, lo, hi, BK: gl.constexpr, BN: gl.constexpr, KMAJOR: gl.constexpr = 0):
    """The words of one step -> the bf16 B tile [BK, BN] in natural K order (as `gluon_int4_gemm`); KMAJOR:
    its transpose [BN, BK] (each thread then holds 16 consecutive inputs of 2 channels a block: 16-byte
    stores into a K-major ring without bank conflicts, where the [BK, BN] tile's STSM.16.MT88 stores
    hit only 2 of 8 bank groups per matrix, 4-way conflicts: ncu, session 11); KMAJOR 2: the same
    transpose as bf16 pairs in int32 [BN, BK / 2], one word at a time (`_ASM_WORD`)."""
    if KMAJOR == 2:  # int32 pairs [BN, BK / 2] (`_ASM_WORD`)
        s_lo, z_lo = gl.inline_asm_elementwise(_ASM_PAIR_SZ, "=r,=r,r", [lo], dtype=(gl.int32, gl.int32),
                                               is_pure=True, pack=1)
        s_hi, z_hi = gl.inline_asm_elementwise(_ASM_PAIR_SZ, "=r,=r,r", [hi], dtype=(gl.int32, gl.int32),
                                               is_pure=True, pack=1)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _ASM_WORD, "=r,=r,=r,=r,r,r,r,r,r", [words, _spread(s_lo, words), _spread(z_lo, words),
                                                  _spread(s_hi, words), _spread(z_hi, words)],
            dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [CB, 1, g, j, m, hi, a]
        t = gl.reshape(gl.permute(v, TO_NK_PAIRS.value), (BN, BK // 2))
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, _spread(lo, words), _spread(hi, words)],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
        v = _join8(o0, o1, o2, o3, o4, o5, o6, o7)  # [CB, 1, g, j, m, hi, a, b]
        if KMAJOR:
            t = gl.reshape(gl.permute(v, TO_NK.value), (BN, BK))
        else:
            t = gl.reshape(gl.permute(v, TO_KN.value), (BK, BN))
    return t


@gluon.jit
def _spread(sz, words):
    """A [CB, 8] (block, lane g) tensor over the words' shape [CB, 1, g, j, m]."""
    sz = gl.expand_dims(gl.expand_dims(gl.expand_dims(sz, 1), 3), 4)
    sz, _ = gl.broadcast(sz, words)
    return sz


@gluon.jit
def _probe_sums(p0, p1, p2, p3, p4, c0, c1, c2, c3, c4, c5):
    """The five phase sums plus one step's phase lengths (clock readings c0 .. c5)."""
    return p0 + (c1 - c0), p1 + (c2 - c1), p2 + (c3 - c2), p3 + (c4 - c3), p4 + (c5 - c4)


@gluon.jit
def _deq_step(i, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, DIAG: gl.constexpr = 0, keep=0,
              p0=0, p1=0, p2=0, p3=0, p4=0, PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    """Ring step i: its words and scales from the word ring (a plain row-major view of the TMA tile:
    word m of lane (g, j) of block cb at [cb, 0, g, j, m]; channel 16 cb + c's scale at [cb, c]),
    dequantized into the B ring once the consumer freed the slot; fence (the wgmma and the next TMA
    into the word slot are async-proxy accesses), then both slots signalled.
    Timing-only DIAG variants (wrong products): 1 no tile made; 2 the tile made but not stored (summed
    into `keep`); 3 `keep` (a constant tile) stored, nothing computed; 4 no fence; 5 no barrier
    before the arrives. PROBE: cycles waiting for the words (p0), computing (p1), waiting for the B
    slot (p2), issuing the store (p3), fence + barrier + arrives (p4), summed (returned)."""
    STAGES: gl.constexpr = b_smem.shape[0]
    BN: gl.constexpr = w_view.shape[1] * 16
    s = i % STAGES
    ph = (i // STAGES) & 1
    if PROBE:
        c0 = _clock()
    mbarrier.wait(w_ready.index(s), ph)
    if PROBE:
        c1 = _clock()
    if DIAG == 1:  # timing only: the slots waited for and signalled, no tile made
        mbarrier.wait(b_empty.index(s), ph ^ 1)
        if PROBE:
            c2 = _clock()
            c3 = c2
            c4 = c2
    elif DIAG == 3:
        if PROBE:
            c2 = _clock()
        mbarrier.wait(b_empty.index(s), ph ^ 1)
        if PROBE:
            c3 = _clock()
        b_smem.index(s).store(keep)
        if PROBE:
            c4 = _clock()
    else:
        w = _deq_load(i, w_view, s_view, 64, BN, KMAJOR)
        if PROBE:
            c2 = _clock()
        mbarrier.wait(b_empty.index(s), ph ^ 1)
        if PROBE:
            c3 = _clock()
        if DIAG == 2:
            keep = keep + w
        else:
            b_smem.index(s).store(w)
        if PROBE:
            c4 = _clock()
    if DIAG != 4:
        fence_async_shared()
    if DIAG != 5:
        _barrier()  # every dequantizer's part stored (and its word reads done) before the arrives
    mbarrier.arrive(b_ready.index(s), count=1)
    mbarrier.arrive(w_empty.index(s), count=1)
    if PROBE:
        p0, p1, p2, p3, p4 = _probe_sums(p0, p1, p2, p3, p4, c0, c1, c2, c3, c4, _clock())
    return keep, p0, p1, p2, p3, p4


@gluon.jit
def _deq_load(i, w_view, s_view, BK: gl.constexpr, BN: gl.constexpr, KMAJOR: gl.constexpr = 0):
    """Step i's words and scales from its word slot (loaded: the caller waited), dequantized: the B tile in
    registers."""
    STAGES: gl.constexpr = w_view.shape[0]
    nw: gl.constexpr = gl.num_warps()
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [nw, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    sz_ld: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, w_ld)))  # [CB, 8]
    s = i % STAGES
    words = w_view.index(s).load(w_ld)
    scales = s_view.index(s)
    lo = scales.slice(0, 8, dim=1).load(sz_ld)
    hi = scales.slice(8, 8, dim=1).load(sz_ld)
    return _dequant_tile(words, lo, hi, BK, BN, KMAJOR)


@gluon.jit
def _deq_pair(i, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, keep, p0, p1, p2, p3, p4,
              PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    """Ring steps i and i + 1 as one: both steps' words loaded and dequantized together (twice the
    independent work in flight), both tiles stored, then ONE fence and barrier for the two (the
    fence waits for every store of the thread: paid once a pair). PROBE as `_deq_step` (p0: the
    first step's word wait, p1: the rest of the loads and the compute)."""
    STAGES: gl.constexpr = b_smem.shape[0]
    BN: gl.constexpr = w_view.shape[1] * 16
    sa = i % STAGES
    sb = (i + 1) % STAGES
    if PROBE:
        c0 = _clock()
    mbarrier.wait(w_ready.index(sa), (i // STAGES) & 1)
    if PROBE:
        c1 = _clock()
    wa = _deq_load(i, w_view, s_view, 64, BN, KMAJOR)
    mbarrier.wait(w_ready.index(sb), ((i + 1) // STAGES) & 1)
    wb = _deq_load(i + 1, w_view, s_view, 64, BN, KMAJOR)
    if PROBE:
        c2 = _clock()
    mbarrier.wait(b_empty.index(sa), ((i // STAGES) & 1) ^ 1)
    mbarrier.wait(b_empty.index(sb), (((i + 1) // STAGES) & 1) ^ 1)
    if PROBE:
        c3 = _clock()
    b_smem.index(sa).store(wa)
    b_smem.index(sb).store(wb)
    if PROBE:
        c4 = _clock()
    fence_async_shared()
    _barrier()  # every dequantizer's parts stored (and its word reads done) before the arrives
    mbarrier.arrive(b_ready.index(sa), count=1)
    mbarrier.arrive(b_ready.index(sb), count=1)
    mbarrier.arrive(w_empty.index(sa), count=1)
    mbarrier.arrive(w_empty.index(sb), count=1)
    if PROBE:
        p0, p1, p2, p3, p4 = _probe_sums(p0, p1, p2, p3, p4, c0, c1, c2, c3, c4, _clock())
    return keep, p0, p1, p2, p3, p4


@gluon.jit
def _deq_steps(first, n_k, by, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, t_ptr, DIAG: gl.constexpr,
               PROBE: gl.constexpr, PAIR: gl.constexpr = False, KMAJOR: gl.constexpr = 0):
    """Steps first, first + by, ... < n_k (`_deq_step`); PROBE: the sums and the loop's cycles into
    t_ptr[16 pid ..]. DIAG 2 / 3: `keep` starts as the tile of constant words (and DIAG 2 stores its
    sum into slot 0 at the end, so that the tiles are made)."""
    CB: gl.constexpr = w_view.shape[1]
    nw: gl.constexpr = gl.num_warps()
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [nw, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    sz_ld: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, w_ld)))
    t_start = _clock()
    z = t_start - t_start
    p0 = z
    p1 = z
    p2 = z
    p3 = z
    p4 = z
    if DIAG == 2 or DIAG == 3:
        keep = _dequant_tile(gl.full([CB, 1, 8, 4, 4], 0x76543210, gl.int32, w_ld),
                             gl.full([CB, 8], 0x43003C00, gl.int32, sz_ld),
                             gl.full([CB, 8], 0x43003C00, gl.int32, sz_ld), 64, CB * 16, KMAJOR)
    else:
        keep = z
    if PAIR:  # steps two at a time (`_deq_pair`; one partition), an odd last step alone
        for i in range(0, n_k - 1, 2):
            keep, p0, p1, p2, p3, p4 = _deq_pair(i, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, keep,
                                                 p0, p1, p2, p3, p4, PROBE, KMAJOR)
        if n_k % 2 == 1:
            keep, p0, p1, p2, p3, p4 = _deq_step(n_k - 1, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty,
                                                 DIAG, keep, p0, p1, p2, p3, p4, PROBE, KMAJOR)
    else:
        for i in range(first, n_k, by):
            keep, p0, p1, p2, p3, p4 = _deq_step(i, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, DIAG,
                                                 keep, p0, p1, p2, p3, p4, PROBE, KMAJOR)
    if DIAG == 2:
        b_smem.index(0).store(keep)
    if PROBE:
        base = t_ptr + gl.program_id(0) * 16
        gl.store(base, p0)
        gl.store(base + 1, p1)
        gl.store(base + 2, p2)
        gl.store(base + 3, p3)
        gl.store(base + 4, p4)
        gl.store(base + 7, _clock() - t_start)


@gluon.jit
def _dequantizer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty, w_ready,
                 w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, t_ptr, GROUP: gl.constexpr, PARTS: gl.constexpr,
                 DIAG: gl.constexpr, PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    """Steps 0, PARTS, 2 PARTS, ... (PARTS 2: a second partition, `_dequantizer_odd`, makes the odd
    steps' tiles, so that two steps' dequantization chains overlap; PARTS 0: one partition, the steps
    two at a time, `_deq_pair`)."""
    _deq_steps(0, n_k, PARTS, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, t_ptr, DIAG, PROBE,
               PARTS == 0, KMAJOR)


@gluon.jit
def _dequantizer_odd(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty,
                     w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, t_ptr, GROUP: gl.constexpr,
                     PARTS: gl.constexpr, DIAG: gl.constexpr, PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    _deq_steps(1, n_k, 2, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty, t_ptr, DIAG, 0, False, KMAJOR)


@gluon.jit
def _rings(x_desc, w_desc, s_desc, BN: gl.constexpr, STAGES: gl.constexpr, KMAJOR: gl.constexpr = 0):
    """The shared memory: x / word / scale / B tile rings (B [BK, BN] a slot, KMAJOR [BN, BK]; KMAJOR 2: the
    dequantizers' view of it int32 [BN, BK / 2], `b_deq`), the word and scale rings also as plain
    row-major views ([STAGES, CB, 1, 8, 4, 4] and [STAGES, CB, 16] int32) for the dequantizers, and
    the ready / empty barriers of the x, word and B slots."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = BN // 16
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, CB, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BN], s_desc.layout)
    if KMAJOR:
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK],
                                           gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
    else:
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN],
                                           gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))
    flat5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    if _PUBLIC_REINTERPRET:
        w_view = w_smem.reinterpret(gl.int32, [STAGES, CB, 1, 8, 4, 4], flat5)
        s_view = s_smem.reinterpret(gl.int32, [STAGES, CB, 16], flat2)
    else:
        w_view = w_smem._reinterpret(gl.int32, [STAGES, CB, 1, 8, 4, 4], flat5)
        s_view = s_smem._reinterpret(gl.int32, [STAGES, CB, 16], flat2)
    if KMAJOR == 2:  # the dequantizers store int32 pairs: the same bytes (128-byte rows, the same swizzle)
        pairs: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        if _PUBLIC_REINTERPRET:
            b_deq = b_smem.reinterpret(gl.int32, [STAGES, BN, BK // 2], pairs)
        else:
            b_deq = b_smem._reinterpret(gl.int32, [STAGES, BN, BK // 2], pairs)
    else:
        b_deq = b_smem
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(s), count=1)
        mbarrier.init(x_empty.index(s), count=1)
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)
        mbarrier.init(b_ready.index(s), count=1)
        mbarrier.init(b_empty.index(s), count=1)
    fence_async_shared()
    return (x_smem, w_smem, s_smem, b_smem, b_deq, w_view, s_view, x_ready, x_empty, w_ready, w_empty, b_ready,
            b_empty)


# ----------------------------------------------------------------------------- kernel


@gluon.jit(do_not_specialize=["M"])
def _ws_gemm_kernel(x_desc, w_desc, s_desc, out_ptr, part_ptr, cnt_ptr, t_ptr, M, N, K, s_om, GROUP: gl.constexpr,
                    BN: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, DEQ_WARPS: gl.constexpr,
                    DEQ_REGS: gl.constexpr, DEQ_PARTS: gl.constexpr = 1, DIAG: gl.constexpr = 0,
                    PROBE: gl.constexpr = 0, KMAJOR: gl.constexpr = 0):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    split = gl.num_programs(1)
    tiles_m = gl.cdiv(M, BM)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    n_k = K // BK // split  # steps per slice (the wrapper makes the split divide them)
    s0 = pid_k * n_k

    (x_smem, w_smem, s_smem, b_smem, b_deq, w_view, s_view, x_ready, x_empty, w_ready, w_empty, b_ready,
     b_empty) = _rings(x_desc, w_desc, s_desc, BN, STAGES, KMAJOR)
    # (the argument tuples written out in each call: a tuple held in a variable turns its constexprs
    # into tensors)
    off_m = pid_m * BM
    if DEQ_PARTS == 2:
        (acc,) = gl.warp_specialize([
            (_consumer, (x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, n_k, t_ptr, BM, BN, DIAG, PROBE, KMAJOR)),
            (_loader, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty,
                       w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, GROUP, DEQ_PARTS, DIAG)),
            (_dequantizer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_deq, x_ready, x_empty,
                            w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, t_ptr, GROUP, DEQ_PARTS, DIAG, PROBE,
                            KMAJOR)),
            (_dequantizer_odd, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_deq, x_ready,
                                x_empty, w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, t_ptr, GROUP,
                                DEQ_PARTS, DIAG, PROBE, KMAJOR)),
        ], [1, DEQ_WARPS, DEQ_WARPS], [24, DEQ_REGS, DEQ_REGS])
    else:
        (acc,) = gl.warp_specialize([
            (_consumer, (x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, n_k, t_ptr, BM, BN, DIAG, PROBE, KMAJOR)),
            (_loader, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty,
                       w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, GROUP, DEQ_PARTS, DIAG)),
            (_dequantizer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_deq, x_ready, x_empty,
                            w_ready, w_empty, b_ready, b_empty, off_m, pid_n, s0, n_k, t_ptr, GROUP, DEQ_PARTS, DIAG,
                            PROBE, KMAJOR)),
        ], [1, DEQ_WARPS], [24, DEQ_REGS])

    store_tile(acc, out_ptr, part_ptr, cnt_ptr, pid_m * BM, pid_n * BN, M, N, s_om, SPLIT_K)


# ----------------------------------------------------------------------------- host


_PLAIN32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # TMA tiles of words / scales


def descriptors(x: torch.Tensor, qm: torch.Tensor, sz: torch.Tensor, t: WsTiles) -> tuple:
    """TMA descriptors: x's [BM, 64] tiles, the words' [BN / 16, 128] tiles (qm as [N / 16, K / 64 x 128]:
    one 64-input step of BN / 16 channel blocks) and the packed scales' [1, BN] rows."""
    x_desc = TensorDescriptor.from_tensor(x, [t.bm, 64], gl.NVMMASharedLayout.get_default_for([t.bm, 64], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(qm.view(qm.shape[0], -1), [t.bn // 16, 128], _PLAIN32)
    s_desc = TensorDescriptor.from_tensor(sz, [1, t.bn], _PLAIN32)
    return x_desc, w_desc, s_desc


def operands(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             t: WsTiles, sz: torch.Tensor | None, name: str) -> tuple:
    """The wrappers' (this one's and `gluon_int4_ws_streamk`'s) checks and operands: (x with rows TMA can
    read, packed scales / offsets, N, K, group); ValueError (named `name`) for what the kernels cannot do."""
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    if x.dtype != torch.bfloat16 or n % t.bn or group % 64 or k % group:
        raise ValueError(f"{name}: bf16 x, N a multiple of {t.bn}, K and the group of 64 "
                         f"(x {x.dtype}, N {n}, K {k}, group {group})")
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16:
        x = x.contiguous()
    if sz is None and m:
        sz = _cached_scale_offset(scales, zeros)
    return x, sz, n, k, group


def split_for(t: WsTiles, k: int, tiles: int, counters: torch.Tensor | None) -> int:
    """The split-K slices a launch runs: t.split, lowered until it divides K / 64; 1 without enough
    counters (one zeroed int32 per output tile)."""
    split = t.split if counters is not None and counters.numel() >= tiles else 1
    while (k // 64) % split:
        split -= 1
    return split


def ws_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            tiles: WsTiles | None = None, sz: torch.Tensor | None = None,
            counters: torch.Tensor | None = None, diag: int = 0, probe: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T -> [M, N]; W in the mma layout, scales / zeros [G, N] bf16 (or `sz` from
    `packed_scale_offset`). CUDA, bf16, K and the group multiples of 64, N of BN. `diag` / `probe`
    (timing only, scripts/gpu_int4_ws.py --diag): a DIAG variant; int64 [16 x tiles] for the
    dequantizers' and the consumer's cycle sums (`_deq_step`, `_consumer`)."""
    t = tiles or WsTiles()
    x, sz, n, k, group = operands(x, qm, scales, zeros, group_size, t, sz, "ws int4 GEMM")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x_desc, w_desc, s_desc = descriptors(x, qm, sz, t)
    n_tiles = triton.cdiv(m, t.bm) * (n // t.bn)
    split = split_for(t, k, n_tiles, counters)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _ws_gemm_kernel[(n_tiles, split)](x_desc, w_desc, s_desc, out, part, counters if split > 1 else out,
                                      out if probe is None else probe, m, n, k, out.stride(0), GROUP=group, BN=t.bn,
                                      STAGES=t.stages, SPLIT_K=split > 1, DEQ_WARPS=t.deq_warps, DEQ_REGS=t.deq_regs,
                                      DEQ_PARTS=t.deq_parts, DIAG=diag, PROBE=probe is not None, KMAJOR=t.kmajor,
                                      num_warps=t.warps)
    return out


# ----------------------------------------------------------------------------- CPU mirror


def step_tile(qm: torch.Tensor, sz: torch.Tensor, step: int, pid_n: int, bn: int, group: int) -> torch.Tensor:
    """The dequantizers' B tile [64, bn] of one K step in float32, as the kernel makes it: lane (g, j)'s
    word m, nibble hi + 2 a + 4 b -> input 16 j + 4 m + 2 a + b, channel 16 cb + 8 hi + g; the PTX's
    ((128 + q) - (128 + z)) exact, times the scale rounded once to bf16."""
    cb = bn // 16
    words = qm[pid_n * cb:(pid_n + 1) * cb, step].to(torch.int64).view(cb, 8, 4, 4)  # cb, g, j, m
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).view(cb, 8, 4, 4, 2, 2, 2)  # .., b, a, hi
    q = nib.permute(2, 3, 5, 4, 0, 6, 1).reshape(64, bn)  # (j, m, a, b) x (cb, hi, g)
    row = sz[(step * 64) // group, pid_n * bn:(pid_n + 1) * bn]
    scale = (((row & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).float()
    mz = (row >> 16).to(torch.int16).view(torch.bfloat16).float()  # 128 + z
    return ((q.float() + 128.0 - mz) * scale).to(torch.bfloat16).float()


def emulate(x: torch.Tensor, qm: torch.Tensor, sz: torch.Tensor, group: int, tiles: WsTiles, split: int = 1) -> torch.Tensor:
    """The kernel's result in torch (float32; the CPU reference test): per output tile and K slice
    (slice p: steps p n_k .. (p + 1) n_k - 1), the steps' B tiles (`step_tile`) times x in fp32,
    the slices summed in slice order (the split-K epilogue's)."""
    m, k = x.shape
    n = qm.shape[0] * 16
    n_k = k // 64 // split
    out = torch.zeros(m, n, dtype=torch.float32)
    xf = x.float().cpu()
    for pid_n in range(n // tiles.bn):
        cols = slice(pid_n * tiles.bn, (pid_n + 1) * tiles.bn)
        total = torch.zeros(m, tiles.bn)
        for p in range(split):
            acc = torch.zeros(m, tiles.bn)
            for step in range(p * n_k, (p + 1) * n_k):
                acc += xf[:, step * 64:(step + 1) * 64] @ step_tile(qm.cpu(), sz.cpu(), step, pid_n, tiles.bn, group)
            total += acc
        out[:, cols] = total
    return out
