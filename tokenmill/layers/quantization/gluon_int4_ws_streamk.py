"""Gluon kernel (Hopper): the warp-specialized INT4 GEMM (`gluon_int4_ws_gemm`) on a stream-K schedule.

Why: at 256 rows the Llama linears' output tiles do not fill 132 SMs evenly (gate_up: 224 tiles of
256 x 128, 1.7 waves, the second 70% full; down / qkv / o: 32-48 tiles, which a fixed split-K cuts
into equal slices of whole tiles only). Here the grid is G CTAs (one an SM) and the U = tiles x
steps K steps are cut into G equal contiguous ranges: CTA c runs steps [c U / G, (c + 1) U / G),
i.e. the tail of one tile, whole tiles, the head of another. The three partitions (TMA loader,
dequantizers, wgmma consumer) walk the same segments through the same rings as the plain kernel; the
consumer stores a whole tile in bf16 at once, and a partial tile's fp32 sum into slot
c - c(first step of the tile) of a workspace; the last of the tile's segments to arrive (a counter per
tile, reset by it) sums the slots in K order and stores the tile. The step -> CTA map (`cta_of`) and
the segment walk are mirrored on the CPU by `segments` (tests/layers/test_int4_ws_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenmill.layers.quantization.gluon_int4_ws_gemm import (
    _barrier,
    _deq_step,
    _load_in,
    _rings,
    descriptors,
    operands,
)
from tokenmill.layers.quantization.int4_ws_route import WsTiles


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


@gluon.jit
def _sk_consumer(x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om,
                 tiles_m, n_k, total, BM: gl.constexpr, BN: gl.constexpr):
    STAGES: gl.constexpr = x_smem.shape[0]
    num_warps: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BN, 16])
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    mn = N.to(gl.int64) * M
    while u < end:
        t = u // n_k
        k0 = u % n_k
        k1 = gl.minimum(n_k, k0 + end - u)
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
        s = it % STAGES
        mbarrier.wait(x_ready.index(s), (it // STAGES) & 1)
        mbarrier.wait(b_ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(x_smem.index(s), b_smem.index(s), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        for j in range(1, k1 - k0):
            s = (it + j) % STAGES
            ph = ((it + j) // STAGES) & 1
            mbarrier.wait(x_ready.index(s), ph)
            mbarrier.wait(b_ready.index(s), ph)
            acc = warpgroup_mma(x_smem.index(s), b_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            _barrier()
            p = (it + j - 1) % STAGES
            mbarrier.arrive(x_empty.index(p), count=1)
            mbarrier.arrive(b_empty.index(p), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        _barrier()
        p = (it + k1 - k0 - 1) % STAGES
        mbarrier.arrive(x_empty.index(p), count=1)
        mbarrier.arrive(b_empty.index(p), count=1)
        it += k1 - k0
        # the segment's epilogue (stores from the accumulator's layout; the producers run on meanwhile)
        pid_m = t % tiles_m
        pid_n = t // tiles_m
        om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
        on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
        o_mask = gl.expand_dims(om < M, 1)
        if (k1 - k0) == n_k:
            o_off = gl.expand_dims(om.to(gl.int64) * s_om, 1) + gl.expand_dims(on, 0)
            gl.store(out_ptr + o_off, acc.to(gl.bfloat16), mask=o_mask)
        else:
            first = _cta_of(t * n_k, total, grid)
            nseg = _cta_of((t + 1) * n_k - 1, total, grid) - first + 1
            p_off = gl.expand_dims(om.to(gl.int64) * N, 1) + gl.expand_dims(on, 0)
            gl.store(part_ptr + (c - first) * mn + p_off, acc, mask=o_mask)
            _barrier()
            arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
            if arrived == nseg - 1:
                tot = gl.zeros([BM, BN], gl.float32, layout=acc_l)
                for sl in range(nseg):
                    tot += gl.load(part_ptr + sl * mn + p_off, mask=o_mask, other=0.0, cache_modifier=".cg")
                o_off = gl.expand_dims(om.to(gl.int64) * s_om, 1) + gl.expand_dims(on, 0)
                gl.store(out_ptr + o_off, tot.to(gl.bfloat16), mask=o_mask)
                gl.atomic_xchg(cnt_ptr + t, 0)
        u += k1 - k0


@gluon.jit
def _sk_loader(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty, w_ready,
               w_empty, b_ready, b_empty, tiles_m, n_k, total, GROUP: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    while u < end:
        t = u // n_k
        k0 = u % n_k
        k1 = gl.minimum(n_k, k0 + end - u)
        off_m = (t % tiles_m) * BM
        off_cb = (t // tiles_m) * CB
        for j in range(k1 - k0):
            _load_in(it + j, k0 + j, off_m, off_cb, ((k0 + j) * BK) // GROUP, x_desc, w_desc, s_desc, x_smem, w_smem,
                     s_smem, x_ready, x_empty, w_ready, w_empty)
        it += k1 - k0
        u += k1 - k0


@gluon.jit
def _sk_dequantizer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty, w_ready,
                    w_empty, b_ready, b_empty, tiles_m, n_k, total, GROUP: gl.constexpr):
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    for i in range(end - u):  # the ring steps are the CTA's steps in order, whatever their tiles
        _deq_step(i, w_view, s_view, b_smem, w_ready, w_empty, b_ready, b_empty)


@gluon.jit(do_not_specialize=["M"])
def _ws_streamk_kernel(x_desc, w_desc, s_desc, out_ptr, part_ptr, cnt_ptr, M, N, K, s_om, GROUP: gl.constexpr,
                       BN: gl.constexpr, STAGES: gl.constexpr, DEQ_WARPS: gl.constexpr, DEQ_REGS: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    tiles_m = gl.cdiv(M, BM)
    n_k = K // BK
    total = tiles_m * (N // BN) * n_k
    (x_smem, w_smem, s_smem, b_smem, _, w_view, s_view, x_ready, x_empty, w_ready, w_empty, b_ready,
     b_empty) = _rings(x_desc, w_desc, s_desc, BN, STAGES)
    worker_args = (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, b_smem, x_ready, x_empty, w_ready,
                   w_empty, b_ready, b_empty, tiles_m, n_k, total, GROUP)
    gl.warp_specialize([
        (_sk_consumer, (x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om,
                        tiles_m, n_k, total, BM, BN)),
        (_sk_loader, worker_args),
        (_sk_dequantizer, worker_args),
    ], [1, DEQ_WARPS], [24, DEQ_REGS])


@functools.lru_cache(maxsize=256)
def max_segments(tiles: int, n_k: int, grid: int) -> int:
    """The most CTAs sharing one tile (the workspace's slots)."""
    total = tiles * n_k
    return max(cta_of((t + 1) * n_k - 1, total, grid) - cta_of(t * n_k, total, grid) + 1 for t in range(tiles))


def ws_streamk_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    tiles: WsTiles, counters: torch.Tensor, sz: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T -> [M, N] on `tiles.sk` CTAs (stream-K); `counters`: zeroed int32, one per
    output tile (left zeroed)."""
    t = tiles
    x, sz, n, k, group = operands(x, qm, scales, zeros, group_size, t, sz, "ws stream-K int4 GEMM")
    m = x.shape[0]
    n_tiles = triton.cdiv(m, t.bm) * (n // t.bn) if m else 0
    if t.sk < 1 or counters.numel() < n_tiles:
        raise ValueError(f"ws stream-K int4 GEMM: sk >= 1, a counter per tile ({t.label()}, {counters.numel()} "
                         f"counters for {n_tiles} tiles)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = min(t.sk, n_tiles * (k // 64))
    part = torch.empty((max_segments(n_tiles, k // 64, grid), m, n), dtype=torch.float32, device=x.device)
    x_desc, w_desc, s_desc = descriptors(x, qm, sz, t)
    _ws_streamk_kernel[(grid,)](x_desc, w_desc, s_desc, out, part, counters, m, n, k, out.stride(0), GROUP=group,
                                BN=t.bn, STAGES=t.stages, DEQ_WARPS=t.deq_warps, DEQ_REGS=t.deq_regs,
                                num_warps=t.warps)
    return out
