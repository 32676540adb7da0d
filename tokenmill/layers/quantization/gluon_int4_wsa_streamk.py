"""Gluon kernel (Hopper): the warp-specialized swapped INT4 GEMM (`gluon_int4_wsa_gemm`) on a stream-K schedule.

Why: at 256 rows gate_up's output tiles (224 of 128 channels x 256 tokens) do not fill 132 SMs evenly
(1.7 waves), and the skinny linears' few tiles are cut by a fixed split-K into equal slices of whole
tiles only. Here the grid is G CTAs and the U = tiles x steps K steps are cut into G equal contiguous
ranges: CTA c runs steps [c U / G, (c + 1) U / G), i.e. the tail of one tile, whole tiles, the head of
another (the walk's CPU mirror: `segments`, `cta_of`; tests/layers/test_int4_wsa_gemm.py). The
loader and the consumers walk the same segments through one ring, as in the plain kernel; a whole
tile is stored in bf16 at once, a partial tile's fp32 sum into slot c - c(first step of the tile) of
a workspace, and the last of the tile's segments to arrive (a counter per tile, reset by it) sums the
slots in K order and stores the tile. No CTA ever waits for another.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from tokenmill.layers.quantization.gluon_int4_wsa_gemm import (
    _barrier,
    _rings,
    _steps,
    _tma_load,
    checked_shape,
    descriptors,
    operands,
)
from tokenmill.layers.quantization.int4_wsa_route import WsaTiles


def segments(tiles: int, n_k: int, grid: int) -> list[list[tuple[int, int, int]]]:
    """Per CTA its (tile, first step, end step) segments, in order: the kernel's walk."""
    total = tiles * n_k
    out = []
    for c in range(grid):
        u, end, seg = (c * total) // grid, ((c + 1) * total) // grid, []
        while u < end:
            t, k0 = u // n_k, u % n_k
            k1 = min(n_k, k0 + end - u)
            seg.append((t, k0, k1))
            u += k1 - k0
        out.append(seg)
    return out


def cta_of(u: int, total: int, grid: int) -> int:
    """The CTA whose range holds global step u (start_c <= u < end_c, start_c = c total // grid)."""
    return ((u + 1) * grid - 1) // total


@gluon.jit
def _cta_of(u, total, grid):
    return ((u + 1) * grid - 1) // total


@functools.lru_cache(maxsize=256)
def max_segments(tiles: int, n_k: int, grid: int) -> int:
    """The most CTAs sharing one tile (the workspace's slots)."""
    total = tiles * n_k
    return max(cta_of((t + 1) * n_k - 1, total, grid) - cta_of(t * n_k, total, grid) + 1 for t in range(tiles))


@gluon.jit
def _sk_consumer(x_smem, w_view, s_view, ready, empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om, tiles_t, n_k, total,
                 BC: gl.constexpr, BT: gl.constexpr, DEPTH: gl.constexpr):
    """Per segment: its steps (`gluon_int4_wsa_gemm._steps`: the last wgmma retired and the slots
    freed at its end), then the segment's epilogue."""
    W: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, W], [0, 1])  # channels contiguous per thread
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    mn = N.to(gl.int64) * M
    while u < end:
        t = u // n_k
        k0 = u % n_k
        n = gl.minimum(n_k, k0 + end - u) - k0
        acc = gl.zeros([BC, BT], gl.float32, layout=acc_l)
        acc = _steps(it, n, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, DEPTH, True)  # a segment: n >= 1
        it += n
        # the segment's epilogue (the loader runs on meanwhile)
        pid_t = t % tiles_t
        pid_c = t // tiles_t
        if n == n_k:
            accT = gl.convert_layout(acc.to(gl.bfloat16), out_l)
            oc = pid_c * BC + gl.arange(0, BC, layout=gl.SliceLayout(1, out_l))
            ot = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
            o_off = gl.expand_dims(oc, 1) + gl.expand_dims(ot.to(gl.int64) * s_om, 0)
            gl.store(out_ptr + o_off, accT, mask=gl.expand_dims(ot < M, 0))
        else:  # fp32 partials straight from the accumulator's layout: slot [token, channel] as [M, N]
            first = _cta_of(t * n_k, total, grid)
            nseg = _cta_of((t + 1) * n_k - 1, total, grid) - first + 1
            pc = pid_c * BC + gl.arange(0, BC, layout=gl.SliceLayout(1, acc_l))
            pt = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, acc_l))
            p_off = gl.expand_dims(pc, 1) + gl.expand_dims(pt.to(gl.int64) * N, 0)
            gl.store(part_ptr + (c - first) * mn + p_off, acc, mask=gl.expand_dims(pt < M, 0))
            _barrier()
            arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
            if arrived == nseg - 1:
                oc = pid_c * BC + gl.arange(0, BC, layout=gl.SliceLayout(1, out_l))
                ot = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
                o_mask = gl.expand_dims(ot < M, 0)
                q_off = gl.expand_dims(oc, 1) + gl.expand_dims(ot.to(gl.int64) * N, 0)
                tot = gl.zeros([BC, BT], gl.float32, layout=out_l)
                for sl in range(nseg):
                    tot += gl.load(part_ptr + sl * mn + q_off, mask=o_mask, other=0.0, cache_modifier=".cg")
                o_off = gl.expand_dims(oc, 1) + gl.expand_dims(ot.to(gl.int64) * s_om, 0)
                gl.store(out_ptr + o_off, tot.to(gl.bfloat16), mask=o_mask)
                gl.atomic_xchg(cnt_ptr + t, 0)
        u += n


@gluon.jit
def _sk_loader(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, ready, empty, tiles_t, n_k, total,
               GROUP: gl.constexpr):
    """The CTA's steps in order, whatever their tiles, into the ring (as the plain kernel's loader)."""
    STAGES: gl.constexpr = x_smem.shape[0]
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u0 = (c * total) // grid
    end = ((c + 1) * total) // grid
    for i in range(end - u0):
        u = u0 + i
        t = u // n_k
        k = u % n_k
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(x_desc, [(t % tiles_t) * BT, k * BK], ready.index(s), x_smem.index(s))
        _tma_load(w_desc, [(t // tiles_t) * CB, k * 128], ready.index(s), w_smem.index(s))
        _tma_load(s_desc, [(k * BK) // GROUP, (t // tiles_t) * CB * 16], ready.index(s), s_smem.index(s))


@gluon.jit(do_not_specialize=["M"])
def _wsa_streamk_kernel(x_desc, w_desc, s_desc, out_ptr, part_ptr, cnt_ptr, M, N, K, s_om, GROUP: gl.constexpr,
                        STAGES: gl.constexpr, DEPTH: gl.constexpr = 1):
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    tiles_t = gl.cdiv(M, BT)
    n_k = K // BK
    total = tiles_t * (N // (16 * CB)) * n_k
    x_smem, w_smem, s_smem, w_view, s_view, ready, empty = _rings(x_desc, w_desc, s_desc, STAGES)
    gl.warp_specialize([
        (_sk_consumer, (x_smem, w_view, s_view, ready, empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om, tiles_t, n_k,
                        total, 16 * CB, BT, DEPTH)),
        (_sk_loader, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, ready, empty, tiles_t, n_k,
                      total, GROUP)),
    ], [1], [24])


def wsa_streamk_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     tiles: WsaTiles, counters: torch.Tensor, sz: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 in the swapped GEMM's K order @ W^T -> [M, N] on `tiles.sk` CTAs (stream-K);
    `counters`: zeroed int32, one per output tile (left zeroed)."""
    t = tiles
    m, n, k, group = checked_shape(x, qm, group_size, t, "wsa stream-K int4 GEMM", even=False)
    n_tiles = triton.cdiv(m, t.bt) * (n // t.bc) if m else 0
    if t.sk < 1 or counters.numel() < n_tiles:
        raise ValueError(f"wsa stream-K int4 GEMM: sk >= 1, a counter per tile ({t.label()}, {counters.numel()} "
                         f"counters for {n_tiles} tiles)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, sz = operands(x, scales, zeros, sz)
    grid = min(t.sk, n_tiles * (k // 64))
    part = torch.empty((max_segments(n_tiles, k // 64, grid), m, n), dtype=torch.float32, device=x.device)
    x_desc, w_desc, s_desc = descriptors(x, qm, sz, t)
    _wsa_streamk_kernel[(grid,)](x_desc, w_desc, s_desc, out, part, counters, m, n, k, out.stride(0), GROUP=group,
                                 STAGES=t.stages, DEPTH=t.depth, num_warps=4 * t.wgs)
    return out
